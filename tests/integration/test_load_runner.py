"""run_load, the engine of pdserve bench, against real servers on loopback: its duration bound and its
gRPC and OpenAI backends."""

from __future__ import annotations

import asyncio

from pdserve.loadgen.metrics import RequestRecord
from tests.integration._pipeline import local_pipeline


async def test_run_load_stops_by_itself_with_partial_results(embedded_dir):
    """A hard duration bound cancels in-flight requests, keeps their partial records, frees blocks."""
    from pdserve.loadgen.runner import run_load
    from pdserve.loadgen.targets import GrpcBackend
    from pdserve.loadgen.workload import RequestSpec

    specs = [RequestSpec(i, 0.05 * i, (5, 6, 7) * 10, 1500, "synthetic") for i in range(4)]
    specs.append(RequestSpec(4, 60.0, (5,), 3, "synthetic"))  # due long after the bound: never sent
    async with local_pipeline(embedded_dir, "split") as pipe:
        async with GrpcBackend(pipe.address) as backend:
            records = await asyncio.wait_for(run_load(backend, specs, max_duration_s=1.5), 30)
        assert await pipe.wait_idle() == 0
    assert [r.index for r in records] == [0, 1, 2, 3]
    for r in records:
        assert isinstance(r, RequestRecord)
        assert r.error.startswith("cancelled") and not r.ok
        assert 0 < r.output_tokens < 1500


async def test_openai_backend_gives_the_grpc_token_counts(embedded_dir):
    """The same requests through pdserve's HTTP API (bench --backend openai) and its gRPC API."""
    from pdserve.loadgen.runner import run_load
    from pdserve.loadgen.targets import GrpcBackend, OpenAIBackend
    from pdserve.loadgen.workload import RequestSpec

    specs = [RequestSpec(i, 0.02 * i, tuple(range(10 + i, 40 + 3 * i)), 3 + 2 * i, "synthetic") for i in range(5)]
    async with local_pipeline(embedded_dir, "split", http=True) as pipe:
        async with GrpcBackend(pipe.address) as grpc_backend:
            by_grpc = await asyncio.wait_for(run_load(grpc_backend, specs), 60)
        async with OpenAIBackend(pipe.http_url) as http_backend:
            info = await http_backend.info()
            by_http = await asyncio.wait_for(run_load(http_backend, specs), 60)
        assert await pipe.wait_idle() == 0
    assert info.max_model_len > 0 and info.model == "test-model"  # the served id, never the folder's path
    for g, h in zip(by_grpc, by_http):
        assert g.ok and h.ok, (g.error, h.error)
        assert g.output_tokens == h.output_tokens == g.max_tokens
        assert h.finish_reason == "length" and h.prefill_s > 0 and h.kv_transfer_s > 0
        assert h.token_times_s == sorted(h.token_times_s) and h.ttft_s > 0
