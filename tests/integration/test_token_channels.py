"""Token channels over real gRPC on loopback: the middle tokens of every request come on one stream
per worker, yet the text equals the transformers reference; a channel that closes under a request
migrates it (split) or ends it with UNAVAILABLE (colocated), with no KV block left behind, and the
router opens the channel again for later requests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.client import Client, make_request
from pdserve.router.token_channel import ROUTER_CHANNEL_ID
from pdserve.rpc.auth import internal_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import hf_greedy, mixed_prompts
from tests.integration._pipeline import local_pipeline


async def open_channels(pipe, roles=("decode", "colocated")) -> list:
    """Open the router's token channel on every worker of ``roles``; returns their handles."""
    handles = [h for h in pipe.router.core.pool.workers if h.role in roles]
    for h in handles:
        h.tokens.subscribe("opening")  # not open yet: this starts opening it
    for _ in range(500):
        if all(h.tokens.ready for h in handles):
            return handles
        await asyncio.sleep(0.01)
    raise AssertionError("token channels did not open")


def tokens_sent(pipe) -> int:
    return sum(w.worker.host.channels.tokens_sent for w in pipe.workers)


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_tokens_through_the_channel_equal_transformers(embedded_dir, placement):
    tok = Tokenizer.from_folder(embedded_dir)
    ids = [tok.encode(p) for p in mixed_prompts()]
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        await open_channels(pipe)
        results = await asyncio.gather(
            *[client.generate(make_request("", prompt_token_ids=i, max_tokens=24, temperature=0)) for i in ids]
        )
        for prompt_ids, res in zip(ids, results):
            assert not res.error
            assert res.token_ids == hf_greedy(embedded_dir, prompt_ids, 24), tok.decode(prompt_ids)
        # every request's first and last batch came on its call; much of the rest on the channel
        total = sum(len(r.token_ids) for r in results)
        assert len(ids) <= tokens_sent(pipe) <= total - 2 * len(ids)
        assert await pipe.wait_idle() == 0


def close_worker_channel(pipe, address: str) -> None:
    """Close this router's channel on the worker at ``address`` from the worker's side."""
    channels = next(w for w in pipe.workers if w.address == address).worker.host.channels
    channels.close(channels._open[ROUTER_CHANNEL_ID])


async def stream_closing_channel(pipe, client, request, after: int):
    """Stream ``request``; after ``after`` tokens, close the channel of the worker that serves it."""
    tokens, error, closed = [], None, None
    async for msg in client.stream(request, timeout=60):
        kind = msg.WhichOneof("kind")
        if kind == "chunk":
            tokens += msg.chunk.token_ids
            if closed is None and len(tokens) >= after:
                busy = [h for h in pipe.router.core.pool.workers if h.role != "prefill" and h.active_requests]
                closed = busy[0].address
                close_worker_channel(pipe, closed)
        elif kind == "error":
            error = msg.error
    return tokens, error, closed


async def test_a_closed_channel_migrates_the_request_with_nothing_lost(embedded_dir):
    request = dict(prompt="Once upon a time there was", max_tokens=48, ignore_eos=True, temperature=0)
    async with local_pipeline(embedded_dir, "split", num_decode=2) as pipe, Client(pipe.address) as client:
        ref = await client.generate(make_request(**request))
        handles = await open_channels(pipe)
        tokens, error, closed = await stream_closing_channel(pipe, client, make_request(**request), 10)
        assert error is None and closed is not None
        assert tokens == ref.token_ids  # nothing lost, nothing twice
        assert pipe.router.core.metrics.migrations._value.get() == 1
        assert await pipe.wait_idle() == 0
        # the router opens that channel again and later requests use it
        await asyncio.sleep(1.1)
        assert await open_channels(pipe) == handles
        before = tokens_sent(pipe)
        again = await client.generate(make_request(**request))
        assert again.token_ids == ref.token_ids and tokens_sent(pipe) > before


async def test_a_closed_channel_ends_a_colocated_request_with_unavailable_and_others_go_on(embedded_dir):
    request = dict(prompt="Once upon a time there was", max_tokens=48, ignore_eos=True, temperature=0)
    async with local_pipeline(embedded_dir, "colocated") as pipe, Client(pipe.address) as client:
        ref = await client.generate(make_request(**request))
        await open_channels(pipe)
        tokens, error, closed = await stream_closing_channel(pipe, client, make_request(**request), 10)
        assert closed is not None and error is not None and error.code == "UNAVAILABLE"
        assert "token channel" in error.message
        assert tokens == ref.token_ids[: len(tokens)]
        assert await pipe.wait_idle() == 0
        after = await client.generate(make_request(**request))  # without the channel, on its call
        assert after.token_ids == ref.token_ids


async def test_a_channel_without_an_id_is_refused(embedded_dir):
    async with local_pipeline(embedded_dir, "colocated") as pipe:
        async with internal_channel(pipe.workers[0].address, None) as ch:
            stream = worker_pb2_grpc.WorkerServiceStub(ch).TokenChannel(worker_pb2.TokenChannelRequest())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "channel_id" in err.value.details()
