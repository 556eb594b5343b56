"""Prefix reuse across the real pipeline: conditional disaggregation (short uncached prompts are
prefilled on the decode worker, which keeps the prefix blocks of KV it was sent) and prefix-aware
routing of a conversation's turns (float32, output equal to transformers)."""

from __future__ import annotations

import asyncio
import random

from pdserve.router.client import Client, make_request
from pdserve.rpc.auth import internal_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import hf_greedy
from tests.integration._pipeline import local_pipeline


async def stats(address: str) -> worker_pb2.WorkerStats:
    async with internal_channel(address, None) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())


def greedy(ids: list[int], n: int = 12):
    return make_request("", prompt_token_ids=ids, max_tokens=n, temperature=0, ignore_eos=True)


async def test_short_uncached_prompts_are_prefilled_on_the_decode_worker(embedded_dir):
    rng = random.Random(11)
    long = [rng.randrange(1, 1000) for _ in range(100)]
    follow_up = long[:96] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 6 blocks shared, 10 new tokens
    short = long[:20]
    async with local_pipeline(embedded_dir, "split", local_prefill_tokens=32) as pipe, Client(pipe.address) as client:
        first = await client.generate(greedy(long))
        assert not first.timings.prefilled_on_decode and first.timings.kv_transfer_bytes > 0
        # the router counts on a worker's cache once a stats poll (every 0.1 s) has shown it
        decode_w = next(w for w in pipe.router.core.pool.workers if w.role == "decode")
        deadline = asyncio.get_running_loop().time() + 5
        while decode_w.cached_kv_blocks <= 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        alone = await client.generate(greedy(short))
        assert alone.timings.prefilled_on_decode and alone.timings.kv_transfer_bytes == 0
        # the decode worker keeps the blocks of the KV it was sent: only 10 tokens are new to it
        again = await client.generate(greedy(follow_up))
        assert again.timings.prefilled_on_decode and again.timings.kv_transfer_bytes == 0
        assert again.timings.cached_prompt_tokens == 96  # 6 blocks of the 100 positions pushed for `long`
        for ids, res in ((long, first), (short, alone), (follow_up, again)):
            assert res.token_ids == hf_greedy(embedded_dir, ids, 12)
        assert await pipe.wait_idle() == 0
        metrics = pipe.router.core.metrics
        assert metrics.prefilled_on_decode._value.get() == 2
        assert metrics.cached_prompt_tokens._value.get() >= 96


async def test_a_conversation_follows_its_prefix_across_colocated_workers(embedded_dir):
    rng = random.Random(12)
    turns = [[rng.randrange(1, 1000) for _ in range(48)]]
    for _ in range(3):
        turns.append(turns[-1] + [rng.randrange(1, 1000) for _ in range(24)])
    async with local_pipeline(embedded_dir, "colocated", num_decode=2) as pipe, Client(pipe.address) as client:
        for ids in turns:
            res = await client.generate(greedy(ids))
            assert res.token_ids == hf_greedy(embedded_dir, ids, 12)
        hits = [(await stats(w.address)).prefix_hit_tokens for w in pipe.workers]
        # every later turn found all the earlier turn's prompt blocks: they all went to one worker
        assert sorted(hits) == [0, sum((len(t) - 24) // 16 * 16 for t in turns[1:])]


async def test_the_push_leaves_out_the_blocks_the_decode_worker_holds(embedded_dir):
    rng = random.Random(13)
    first_ids = [rng.randrange(1, 1000) for _ in range(100)]
    second_ids = first_ids[:96] + [rng.randrange(1, 1000) for _ in range(40)]
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        first = await client.generate(greedy(first_ids))
        second = await client.generate(greedy(second_ids))
        for ids, res in ((first_ids, first), (second_ids, second)):
            assert res.token_ids == hf_greedy(embedded_dir, ids, 12)
            assert not res.timings.prefilled_on_decode
        # 100 positions pushed for the first; the decode worker held 6 blocks (96) of the second's 136
        assert second.timings.kv_transfer_bytes * 100 == first.timings.kv_transfer_bytes * 40
        assert await pipe.wait_idle() == 0  # the held prefix was handed to the request, then freed
