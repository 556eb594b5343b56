"""Start real gRPC workers and a router on loopback inside the test's event loop (no Ray)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from pdserve.v1 import worker_pb2, worker_pb2_grpc


@dataclass
class Pipeline:
    address: str  # router host:port
    workers: list  # RunningWorker objects
    router: object  # RunningRouter
    held: list = field(default_factory=list)  # what each busy worker held at the last used_blocks()

    @property
    def http_url(self) -> str:
        return f"http://{self.router.http_address}"

    async def used_blocks(self) -> int:
        """Sum of used KV blocks over all workers, read through WorkerService.GetStats."""
        from pdserve.rpc.auth import internal_channel

        total = 0
        self.held = []
        for w in self.workers:
            async with internal_channel(w.address, None) as ch:
                s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
                held = s.used_kv_blocks + s.num_waiting + s.num_running
                total += held
                if held:
                    counts = f"{s.used_kv_blocks} blocks, {s.num_running} running, {s.num_waiting} waiting"
                    self.held.append(f"{s.role}@{w.address}: {counts}")
        return total

    async def wait_idle(self, timeout_s: float = 10.0) -> int:
        """Poll until no worker holds KV blocks or sequences; returns the last count."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            used = await self.used_blocks()
            if used == 0 or asyncio.get_running_loop().time() > deadline:
                if used:  # shown beside a failed assertion: which worker holds what
                    print("still held after", timeout_s, "s:", "; ".join(self.held))
                return used
            await asyncio.sleep(0.05)


@asynccontextmanager
async def local_pipeline(
    model: Path,
    placement: str = "split",
    num_kv_blocks: int = 512,
    block_size: int = 16,
    dtype: str = "float32",
    http: bool = False,
    api_keys: tuple[str, ...] = (),
    num_decode: int = 1,
    max_requests_per_worker: int = 0,
    tls: tuple[str, str] | None = None,
    routing: str = "prefix-aware",
    local_prefill_tokens: int = 0,
    num_prefill: int = 1,
    stream_interval: int = 1,
    **engine_kw,
):
    """Workers and router on loopback; ``dtype`` defaults to the exact float32 path the reference tests need.
    ``http``: the router also serves the OpenAI API on a free port (``Pipeline.http_url``).
    ``num_prefill`` / ``num_decode``: workers per pool (``num_decode`` colocated workers when colocated;
    auto: switchable workers in those first roles)."""
    import pdserve.colocated_worker.worker as colocated
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    import pdserve.switchable_worker.worker as switchable
    from pdserve.engine.config import EngineConfig

    cfg = EngineConfig(model=str(model), num_kv_blocks=num_kv_blocks, block_size=block_size, dtype=dtype, **engine_kw)
    if placement in ("split", "auto"):
        p_serve, d_serve = (
            (prefill.serve, decode.serve)
            if placement == "split"
            else (partial(switchable.serve, role="prefill"), partial(switchable.serve, role="decode"))
        )
        workers = list(
            await asyncio.gather(
                *[p_serve(cfg) for _ in range(num_prefill)], *[d_serve(cfg) for _ in range(num_decode)]
            )
        )
        r = await router.serve(
            model,
            prefill=[w.address for w in workers[:num_prefill]],
            decode=[w.address for w in workers[num_prefill:]],
            http_port=0 if http else None,
            model_name="test-model",
            api_keys=api_keys,
            max_requests_per_worker=max_requests_per_worker,
            tls=tls,
            routing=routing,
            stream_interval=stream_interval,
            local_prefill_tokens=local_prefill_tokens,
        )
    else:
        workers = list(await asyncio.gather(*[colocated.serve(cfg) for _ in range(num_decode)]))
        r = await router.serve(
            model,
            colocated=[w.address for w in workers],
            http_port=0 if http else None,
            model_name="test-model",
            api_keys=api_keys,
            max_requests_per_worker=max_requests_per_worker,
            tls=tls,
            routing=routing,
            stream_interval=stream_interval,
        )
    try:
        yield Pipeline(r.address, workers, r)
    finally:
        await r.stop()
        for w in workers:
            await w.stop()
