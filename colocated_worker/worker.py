"""Colocated role: one engine loop runs prefill and decode; no KV leaves the process.

It serves the same hardware as a prefill + decode pair would, so that the two placements can be
compared, and it is the placement where splitting does not pay.
"""

from __future__ import annotations

import asyncio

from pdserve.engine.config import for_role
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.colocated_service import ColocatedWorker, colocated_service


async def serve(cfg, host: str = "127.0.0.1", port: int = 0):
    """Build the engine (off the event loop) and serve ColocatedService + WorkerService."""
    from pdserve.worker.host import serve_worker

    engine = await asyncio.to_thread(LLMEngine, for_role(cfg, "colocated"))
    worker = ColocatedWorker(engine)
    return await serve_worker(worker, [colocated_service(worker)], host, port)
