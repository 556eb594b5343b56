"""Admission: more streams than a decode worker steps at once take turns; none stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline


async def test_a_short_request_behind_a_full_decode_batch_is_not_stalled(embedded_dir):
    """6 long streams on a decode worker that steps 4 at a time, then one short request: it ends
    long before the long ones, within a small multiple of its solo time."""
    async with local_pipeline(embedded_dir, "split", max_num_seqs=4) as pipe, Client(pipe.address) as client:
        short = make_request("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
        t = time.monotonic()
        solo = await client.generate(short)
        solo_s = time.monotonic() - t
        longs = [
            asyncio.create_task(
                client.generate(make_request(f"story {i}", max_tokens=600, temperature=0, ignore_eos=True))
            )
            for i in range(6)
        ]
        await asyncio.sleep(0.5)  # all six are decoding
        t = time.monotonic()
        crowded = await client.generate(short)
        crowded_s = time.monotonic() - t
        assert crowded.token_ids == solo.token_ids
        assert not any(task.done() for task in longs), "the long streams should still be running"
        assert crowded_s < 10 * solo_s + 2.0, (crowded_s, solo_s)
        results = await asyncio.gather(*longs)
        assert all(len(r.token_ids) == 600 for r in results)
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement,local_prefill_tokens", [("split", 32), ("split", 0), ("colocated", 0)])
async def test_a_short_request_beside_more_long_streams_than_max_num_seqs(
    embedded_dir, placement, local_prefill_tokens
):
    """More long streams than --max-num-seqs run, then a short request: it ends within a small
    multiple of its solo time, in split placement (prefilled on the decode worker, as a short
    prompt or a next turn is, and with its KV pushed) and colocated; and none of the long
    streams waits for the others."""
    async with (
        local_pipeline(
            embedded_dir, placement, max_num_seqs=4, local_prefill_tokens=local_prefill_tokens, num_kv_blocks=1024
        ) as pipe,
        Client(pipe.address) as client,
    ):
        short = make_request("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
        await client.generate(short)  # warm-up
        t = time.monotonic()
        solo = await client.generate(short)
        solo_s = time.monotonic() - t
        longs = [
            asyncio.create_task(
                client.generate(make_request(f"tale {i}", max_tokens=900, temperature=0, ignore_eos=True))
            )
            for i in range(7)
        ]
        await asyncio.sleep(0.5)  # every long stream admitted (the tiny model prefills in milliseconds)
        t = time.monotonic()
        crowded = await client.generate(short)
        crowded_s = time.monotonic() - t
        assert crowded.token_ids == solo.token_ids
        assert crowded.timings.prefilled_on_decode == (local_prefill_tokens > 0)
        assert not any(task.done() for task in longs), "the long streams should still be running"
        assert crowded_s < 10 * solo_s + 2.0, (crowded_s, solo_s)
        results = await asyncio.gather(*longs)
        assert all(len(r.token_ids) == 900 for r in results)
        assert max(r.ttft_s for r in results) < 10 * solo_s + 2.0, [round(r.ttft_s, 2) for r in results]
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_a_full_cluster_refuses_with_resource_exhausted_and_a_retry_hint(embedded_dir, placement):
    """With every decode (colocated) worker at --max-requests-per-worker, a new request is refused at
    once: RESOURCE_EXHAUSTED over gRPC (with a pushback hint), 429 with Retry-After over HTTP; once
    a stream ends, requests are admitted again."""
    import grpc
    import httpx

    async with (
        local_pipeline(embedded_dir, placement, http=True, max_requests_per_worker=2) as pipe,
        Client(pipe.address) as client,
    ):
        longs = [
            asyncio.create_task(
                client.generate(make_request(f"s{i}", max_tokens=400, ignore_eos=True, request_id=f"long{i}"))
            )
            for i in range(2)
        ]
        await asyncio.sleep(0.3)
        call = client.stub.Generate(make_request("hi", max_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in info.value.details()
        assert ("grpc-retry-pushback-ms", "1000") in tuple(info.value.trailing_metadata())
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert await client.abort("long0")
        await asyncio.gather(*longs)
        assert len((await client.generate(make_request("hi", max_tokens=2))).token_ids) == 2
        assert await pipe.wait_idle() == 0
