"""Colocated role ("both"): one engine loop runs prefill and decode; no KV leaves the process.

It lives beside the decode role because it is the decode engine plus prompt admission; it exists
to compare placements on the same hardware.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.engine.engine import Engine
from pdserve.engine.config import for_role
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.engine.host.worker_common import EngineHost, abort_quietly, admit_prompt, relay_tokens
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc


class ColocatedWorker(worker_pb2_grpc.ColocatedServiceServicer):
    """Composes an EngineHost (engine + its thread); streams every token of a request, the first included."""

    role = "both"

    def __init__(self, engine: Engine, host: EngineHost | None = None) -> None:
        self.engine = engine
        self.host = host or EngineHost(engine)  # a decode worker shares its own (conditional disaggregation)

    @staticmethod
    def _timings(seq: Sequence, end_ns: int) -> generate_pb2.Timings:
        return generate_pb2.Timings(queue_ns=seq.prefill_start_ns - seq.arrival_ns,
                                    prefill_ns=seq.prefill_end_ns - seq.prefill_start_ns,
                                    decode_ns=end_ns - seq.prefill_end_ns, cached_prompt_tokens=seq.num_cached_tokens,
                                    num_preemptions=seq.num_preemptions, preempted_ns=seq.preempted_ns)

    async def Generate(self, request: worker_pb2.ColocatedRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        q = await admit_prompt(self.host, request, context)
        finished = False
        try:
            async for batch in relay_tokens(q, context, self._timings):
                finished = batch.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                yield batch
        finally:
            self.host.streams.close(rid)
            if not finished:
                await abort_quietly(self.host.loop, rid)


async def serve(cfg, host: str = "127.0.0.1", port: int = 0):
    """Build the engine (off the event loop) and serve ColocatedService + WorkerService."""
    from pdserve.engine.host.worker_common import serve_worker

    engine = await asyncio.to_thread(Engine, for_role(cfg, "both"))
    worker = ColocatedWorker(engine)
    return await serve_worker(worker, worker_pb2_grpc.add_ColocatedServiceServicer_to_server,
                              "pdserve.v1.ColocatedService", host, port)
