"""Token channels: the worker's side (relay_tokens, TokenChannels) and the router's (merged_batches,
TokenChannelClient), without gRPC: the calls here are async iterators of real protobuf messages."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.scheduling.sequence import FinishReason
from pdserve.router.token_channel import TokenChannelClient, merged_batches
from pdserve.v1 import generate_pb2, worker_pb2
from pdserve.worker.host import TokenEvent, relay_tokens
from pdserve.worker.token_channel import TokenChannels

WAIT_S = 5


def timings(seq, at_ns) -> generate_pb2.Timings:
    return generate_pb2.Timings(decode_ns=at_ns)


async def relay_steps(steps: list[list[int]], side) -> list[worker_pb2.TokenBatch]:
    """Run relay_tokens over ``steps`` (the tokens of one engine step each, the last one finishing),
    letting the relay catch up after each step; return what it sent on the call."""
    q: asyncio.Queue = asyncio.Queue()
    out: list[worker_pb2.TokenBatch] = []

    async def collect():
        async for b in relay_tokens(q, None, timings, side):
            out.append(b)

    task = asyncio.ensure_future(collect())
    for i, step in enumerate(steps):
        for j, tok in enumerate(step):
            last = i == len(steps) - 1 and j == len(step) - 1
            q.put_nowait(TokenEvent(tok, FinishReason.LENGTH if last else None, None, 1000 + i))
        await asyncio.sleep(0.01)
    await asyncio.wait_for(task, WAIT_S)
    return out


async def test_relay_sends_first_and_last_on_the_call_and_the_middle_on_the_side_channel():
    side_got: list[tuple[int, list[int]]] = []
    call = await relay_steps([[5], [6, 7], [8], [9]], lambda first, toks: side_got.append((first, toks)) or True)
    assert [(b.first_index, list(b.token_ids)) for b in call] == [(0, [5]), (4, [9])]
    assert call[0].HasField("timings") and call[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert side_got == [(1, [6, 7]), (3, [8])]


async def test_relay_without_an_open_channel_sends_everything_on_the_call():
    q: asyncio.Queue = asyncio.Queue()
    channels = TokenChannels()
    side = channels.sender("router-1", "r1")  # names a channel nobody opened
    for i, tok in enumerate([5, 6, 7]):
        q.put_nowait(TokenEvent(tok, FinishReason.STOP if i == 2 else None, None, i))
    batches = []
    async for b in relay_tokens(q, None, timings, side):
        batches.append(b)
        await asyncio.sleep(0)
    assert [(b.first_index, list(b.token_ids)) for b in batches] == [(0, [5, 6, 7])]
    assert channels.sender("", "r1") is None


async def test_a_channel_coalesces_a_steps_requests_into_one_message_and_reopening_closes_the_old():
    channels = TokenChannels()
    first = channels.open("router-1")
    stream = first.batches()
    assert len((await stream.__anext__()).requests) == 0  # the open message
    a, b = channels.sender("router-1", "a"), channels.sender("router-1", "b")
    assert a(1, [10]) and b(3, [20, 21])
    msg = await asyncio.wait_for(stream.__anext__(), WAIT_S)
    assert [(e.request_id, e.first_index, list(e.token_ids)) for e in msg.requests] == [
        ("a", 1, [10]),
        ("b", 3, [20, 21]),
    ]
    second = channels.open("router-1")  # the same router again: the old channel ends
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(stream.__anext__(), WAIT_S)
    channels.close(first)  # closing the replaced one leaves the new one open
    assert a(2, [11])
    channels.close(second)
    assert not a(3, [12])


async def aiter_of(items, delay=0.0):
    for item in items:
        await asyncio.sleep(delay)
        if isinstance(item, BaseException):
            raise item
        yield item


async def test_merged_batches_put_the_call_and_the_channel_back_in_order():
    q: asyncio.Queue = asyncio.Queue()
    call = aiter_of(
        [
            worker_pb2.TokenBatch(token_ids=[1], first_index=0),
            worker_pb2.TokenBatch(token_ids=[5], first_index=4, finish_reason=generate_pb2.FINISH_REASON_STOP),
        ]
    )
    # the channel's pieces arrive after the call's last batch, and out of order
    q.put_nowait((2, [3, 4], None))
    got = []

    async def late():
        await asyncio.sleep(0.02)
        q.put_nowait((1, [2], None))

    asyncio.ensure_future(late())
    async for b in merged_batches(call, q):
        got.append((b.first_index, list(b.token_ids), b.finish_reason))
    assert got == [(0, [1], 0), (1, [2], 0), (2, [3, 4], 0), (4, [5], generate_pb2.FINISH_REASON_STOP)]


async def test_merged_batches_raise_internal_when_the_call_ends_without_a_last_batch():
    q: asyncio.Queue = asyncio.Queue()
    call = aiter_of([worker_pb2.TokenBatch(token_ids=[1], first_index=0)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in merged_batches(call, q):
            pass
    assert err.value.code() == grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in merged_batches(aiter_of([]), None):
            pass


class FakeStub:
    """A worker's TokenChannel RPC: yields the given messages, then fails with ``end``."""

    def __init__(self, messages, end: grpc.aio.AioRpcError | None = None) -> None:
        self.messages, self.end, self.gate = messages, end, asyncio.Event()

    def TokenChannel(self, request):
        stub = self

        class Call:
            cancelled = False

            def cancel(self):
                self.cancelled = True

            async def __aiter__(self):
                for m in stub.messages:
                    yield m
                    await stub.gate.wait()
                if stub.end is not None:
                    raise stub.end

        self.call = Call()
        return self.call


async def test_a_channel_that_closes_fails_its_requests_with_unavailable_and_opens_again_later(monkeypatch):
    lost = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    entry = worker_pb2.ChannelTokens(request_id="r1", first_index=1, token_ids=[7])
    stub = FakeStub([worker_pb2.ChannelBatch(), worker_pb2.ChannelBatch(requests=[entry])], lost)
    client = TokenChannelClient(stub, "127.0.0.1:1", "router-1")
    assert client.subscribe("r0") is None  # not open yet: this request goes without it, and opens it
    for _ in range(100):
        if client.ready:
            break
        await asyncio.sleep(0.01)
    q = client.subscribe("r1")
    assert q is not None
    stub.gate.set()
    assert await asyncio.wait_for(q.get(), WAIT_S) == (1, [7], None)
    err = await asyncio.wait_for(q.get(), WAIT_S)
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
    assert "127.0.0.1:1" in err.details() and "gone" in err.details()
    assert not client.ready and client.subscribe("r2") is None  # closed just now: not reopened at once
    await asyncio.sleep(0.05)
    assert client._task is None
    monkeypatch.setattr("pdserve.router.token_channel.REOPEN_AFTER_S", 0.0)
    client.subscribe("r3")
    assert client._task is not None
    await client.close()  # the router's shutdown: the read stops and its call is cancelled
    assert client._task is None and stub.call.cancelled


async def test_merged_batches_raise_cancelled_when_the_call_is_cancelled():
    """An abort cancels the call; the merged stream ends as the plain call would, not waiting on."""
    q: asyncio.Queue = asyncio.Queue()
    call = aiter_of([worker_pb2.TokenBatch(token_ids=[1], first_index=0), asyncio.CancelledError()], delay=0.01)
    got = []

    async def read():
        async for b in merged_batches(call, q):
            got.append(list(b.token_ids))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(read(), WAIT_S)
    assert got == [[1]]
