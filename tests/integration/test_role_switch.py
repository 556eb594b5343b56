"""Role switching on real switchable workers (gRPC on loopback, float32 greedy): a worker drained and
switched while requests stream loses none of them, leaks no KV block, and every output stays equal
to transformers'; the router switches by itself when one role idles beside a saturated other."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.router.client import Client, make_request
from pdserve.router.role_balancer import Move, RoleBalancer
from pdserve.rpc.auth import internal_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import hf_greedy
from tests.integration._pipeline import local_pipeline


async def worker_stats(address: str) -> worker_pb2.WorkerStats:
    async with internal_channel(address, None) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


async def send_all(client: Client, batch: list[list[int]], max_tokens: int, gap_s: float = 0.03):
    async def one(i: int, ids: list[int]):
        await asyncio.sleep(i * gap_s)
        return await client.generate(
            make_request("", prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))


async def test_switching_roles_under_load_loses_no_request_and_keeps_greedy_output(embedded_dir):
    first, during, after = prompts(1, 8), prompts(2, 6), prompts(3, 6)
    async with local_pipeline(embedded_dir, "auto") as pipe, Client(pipe.address) as client:
        core = pipe.router.core
        core.rebalancer.balancer = RoleBalancer(patience=10**6)  # only the switches this test makes
        pool = core.pool
        assert pool.placement == "auto" and sorted(w.role for w in pool.workers) == ["decode", "prefill"]
        p_addr = next(w.address for w in pool.workers if w.role == "prefill")

        async def switches():
            await asyncio.sleep(0.15)  # requests are in flight on both workers
            assert await core.rebalancer.switch(Move(p_addr, "prefill", "decode", 1.0, 0.5))
            assert (await worker_stats(p_addr)).role == "decode" and pool.placement == "auto"
            assert pool.roles_without_healthy_worker() == []  # no prefill worker: decode workers prefill
            mid = await send_all(client, during, 16)  # served with the prefill role empty
            assert await core.rebalancer.switch(Move(p_addr, "decode", "prefill", 1.0, 0.5))
            return mid

        results, mid = await asyncio.gather(send_all(client, first, 24), switches())
        results += mid
        results += await send_all(client, after, 16)  # split again: KV moves from the switched worker
        for ids, res in zip(first + during + after, results):
            assert res.token_ids == hf_greedy(embedded_dir, ids, len(res.token_ids))
            assert res.finish_reason == "length"
        assert any(r.timings.kv_transfer_bytes > 0 for r in results[-len(after) :])
        assert await pipe.wait_idle() == 0  # no KV block left anywhere
        samples = {
            s.name + str(sorted(s.labels.items())): s.value for m in core.metrics.registry.collect() for s in m.samples
        }
        assert samples["pdserve:role_switches_total[('from_role', 'prefill'), ('to_role', 'decode')]"] == 1
        assert samples["pdserve:role_switches_total[('from_role', 'decode'), ('to_role', 'prefill')]"] == 1
        assert samples["pdserve:local_prefills_total[('reason', 'no_prefill_worker')]"] >= len(during)
        assert (await worker_stats(p_addr)).role == "prefill"


async def test_the_router_moves_an_idle_prefill_worker_to_decode_by_itself(embedded_dir):
    batch = prompts(4, 8)
    async with local_pipeline(embedded_dir, "auto") as pipe, Client(pipe.address) as client:
        core = pipe.router.core
        core.rebalancer.balancer = RoleBalancer(patience=1, cooldown_s=1000.0, high=0.3)
        core.rebalancer.window_s = 0.3
        sent, results = [], []
        for _ in range(3):  # on a busy machine, gaps between steps may keep one batch's windows under `high`
            sent += batch
            results += await send_all(client, batch, 96, gap_s=0.01)  # short prompts, long outputs: decode-bound
            deadline = asyncio.get_running_loop().time() + 2
            while core.rebalancer.task is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if core.rebalancer.task is not None:
                break
        assert core.rebalancer.task is not None, "no switch proposed"
        assert await core.rebalancer.task
        assert [w.role for w in core.pool.workers] == ["decode", "decode"]
        for ids, res in zip(sent, results):
            assert res.token_ids == hf_greedy(embedded_dir, ids, 96)
        assert await pipe.wait_idle() == 0


async def test_set_role_refuses_fixed_workers_and_unknown_roles(embedded_dir):
    async with local_pipeline(embedded_dir, "auto") as auto, local_pipeline(embedded_dir, "split") as split:
        for address, role, code, words in (
            (split.workers[0].address, "decode", grpc.StatusCode.FAILED_PRECONDITION, "fixed role"),
            (auto.workers[0].address, "colocated", grpc.StatusCode.INVALID_ARGUMENT, "unknown role 'colocated'"),
        ):
            async with internal_channel(address, None) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await worker_pb2_grpc.WorkerServiceStub(ch).SetRole(worker_pb2.SetRoleRequest(role=role))
            assert err.value.code() == code and words in err.value.details()
        assert (await worker_stats(auto.workers[0].address)).role == "prefill"
