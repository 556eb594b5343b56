"""Bad requests, duplicate ids, cancellation, aborts and shutdown: clear errors, other requests unharmed, no
block leaks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline

BAD_REQUESTS = [
    (make_request(""), "prompt is empty"),
    (make_request("hello", max_tokens=0), "max_tokens must be >= 1"),
    (make_request("hello", temperature=-1.0), "temperature must be"),
    (make_request("hello", temperature=float("nan")), "NaN"),
    (make_request("hello", top_p=0.0), "top_p must be in (0, 1]"),
    (make_request("hello", top_p=1.5), "top_p must be in (0, 1]"),
    (make_request("hello", top_k=-3), "top_k must be >= -1 (-1 or 0 disables), got -3"),
    (make_request("hello", max_tokens=5000), "exceeds the context window"),
    (make_request("word " * 3000), "context window"),
    (make_request("", prompt_token_ids=[5, 10**6]), "out of range"),
    (make_request("hello", stop=[""]), "stop strings must be non-empty"),
    (make_request("hello", request_id="x" * 100_000), "request_id has 100000 characters; at most 256"),
]


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_bad_requests_get_invalid_argument_and_service_continues(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        for req, needle in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(req)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert needle in info.value.details(), (needle, info.value.details())
            ok = await client.generate(make_request("still serving?", max_tokens=3, ignore_eos=True))
            assert len(ok.token_ids) == 3
        assert await pipe.wait_idle() == 0


async def test_duplicate_request_id_refused(embedded_dir):
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        # in flight for sure: its first tokens arrived, and 1,500 more take far longer than one refusal
        first = client.stream(make_request("a", max_tokens=1500, ignore_eos=True, request_id="dup"))
        head = await anext(first)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(make_request("b", max_tokens=2, request_id="dup"))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        rest = [m async for m in first]
        assert sum(len(m.chunk.token_ids) for m in [head, *rest] if m.HasField("chunk")) == 1500


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_cancel_and_abort_free_every_block(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        long = make_request("a long answer please " * 20, max_tokens=1500, ignore_eos=True)
        # client-side cancellation after two chunks
        call = client.stub.Generate(long)
        got = 0
        async for _ in call:
            got += 1
            if got == 2:
                call.cancel()
                break
        # Abort RPC on another in-flight request, once it streams; a third request runs meanwhile
        aborted_req = make_request("abort me " * 30, max_tokens=1500, ignore_eos=True, request_id="victim")
        streaming = asyncio.Event()
        victim = asyncio.create_task(client.generate(aborted_req, on_text=lambda _: streaming.set()))
        bystander = asyncio.create_task(client.generate(make_request("bystander", max_tokens=30, ignore_eos=True)))
        await asyncio.wait_for(streaming.wait(), 30)
        assert await client.abort("victim")
        res = await victim
        assert res.finish_reason == "abort"
        assert 0 < len(res.token_ids) < 1500
        assert len((await bystander).token_ids) == 30
        assert await client.abort("unknown-id") is False
        assert await pipe.wait_idle() == 0


async def test_context_window_is_capped_by_the_kv_cache(embedded_dir):
    """The router advertises and enforces what a worker's KV cache can hold, not only the model's."""
    async with (
        local_pipeline(embedded_dir, "split", num_kv_blocks=20, block_size=16) as pipe,
        Client(pipe.address) as client,
    ):
        assert (await client.model_info()).max_model_len == 320
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(make_request("", prompt_token_ids=[5] * 300, max_tokens=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context window of 320 tokens" in info.value.details()
        ok = await client.generate(make_request("", prompt_token_ids=[5] * 300, max_tokens=20, ignore_eos=True))
        assert len(ok.token_ids) == 20


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_shutdown_ends_streams_with_an_error_message(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        stream = asyncio.create_task(client.generate(make_request("hi", max_tokens=2000, ignore_eos=True)))
        await asyncio.sleep(0.5)
        await pipe.router.stop()
        res = await asyncio.wait_for(stream, 10)
        assert res.error and "UNAVAILABLE" in res.error and "shutting down" in res.error
        assert 0 < len(res.token_ids) < 2000
