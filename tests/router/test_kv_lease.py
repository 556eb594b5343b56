"""The KV lease of a split request (router/kv_lease.py) over real gRPC calls: a prefill server whose
Prefill stream and a decode server whose Decode stream the test scripts, reached through a real
WorkerPool. The lease holds until the Prefill stream ends well; a failed push, a broken stream or
a prefill worker that stops answering its polls loses it, cancels the decode call and raises
LeaseLost at once."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.router import kv_lease
from pdserve.router.kv_lease import LeaseLost, first_while_leased
from pdserve.router.pool import WorkerPool
from pdserve.rpc.server import start_server
from pdserve.v1 import worker_pb2, worker_pb2_grpc

WAIT_S = 5
END = "end"


class ScriptedPrefill(worker_pb2_grpc.PrefillServiceServicer):
    """Sends the first token, then does what the test puts in ``script``: a message, a status to
    abort with, or END."""

    def __init__(self) -> None:
        self.script: asyncio.Queue = asyncio.Queue()

    async def Prefill(self, request, context):
        yield worker_pb2.PrefillResponse(first_token=7)
        while (action := await self.script.get()) != END:
            if isinstance(action, grpc.StatusCode):
                await context.abort(action, "scripted prefill failure")
            yield action


class ScriptedDecode(worker_pb2_grpc.DecodeServiceServicer):
    """Streams what the test puts in ``script`` (TokenBatch, a status to abort with, or END);
    ``cancelled`` is set when the router cancels the call."""

    def __init__(self) -> None:
        self.script: asyncio.Queue = asyncio.Queue()
        self.cancelled = asyncio.Event()

    async def Decode(self, request, context):
        try:
            while (action := await self.script.get()) != END:
                if isinstance(action, grpc.StatusCode):
                    await context.abort(action, "scripted decode failure")
                yield action
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class Split:
    """One request in flight: its Prefill call (first message read) and its Decode call."""

    def __init__(self, prefill_timeout: float | None = None) -> None:
        self.prefill_timeout = prefill_timeout

    async def __aenter__(self) -> Split:
        self.prefill, self.decode = ScriptedPrefill(), ScriptedDecode()
        self.prefill_server, p_port = await start_server(
            [(worker_pb2_grpc.add_PrefillServiceServicer_to_server, self.prefill, "pdserve.v1.PrefillService")]
        )
        self.decode_server, d_port = await start_server(
            [(worker_pb2_grpc.add_DecodeServiceServicer_to_server, self.decode, "pdserve.v1.DecodeService")]
        )
        self.pool = WorkerPool([f"127.0.0.1:{p_port}"], [f"127.0.0.1:{d_port}"], [])
        self.pusher, self.decode_w = self.pool.workers
        self.decode_call = self.decode_w.decode.Decode(worker_pb2.DecodeRequest(request_id="r"))
        self.prefill_call = self.pusher.prefill.Prefill(
            worker_pb2.PrefillRequest(request_id="r"), timeout=self.prefill_timeout
        )
        first = await asyncio.wait_for(self.prefill_call.read(), WAIT_S)
        assert first.first_token == 7
        return self

    async def __aexit__(self, *exc) -> None:
        self.decode_call.cancel()
        self.prefill_call.cancel()
        await self.pool.close()
        await self.prefill_server.stop(0)
        await self.decode_server.stop(0)

    async def events(self):
        async for batch in self.decode_call:
            yield batch

    def lease(self, events=None) -> asyncio.Task:
        return asyncio.ensure_future(
            first_while_leased(events or self.events(), self.decode_call, self.prefill_call, self.pusher, self.pool)
        )

    async def assert_decode_cancelled(self) -> None:
        assert self.decode_call.cancelled()
        await asyncio.wait_for(self.decode.cancelled.wait(), WAIT_S)


async def lost(task: asyncio.Task) -> LeaseLost:
    """The LeaseLost ``task`` raises, checked to come well within the wait for a KV."""
    t = time.monotonic()
    with pytest.raises(LeaseLost) as info:
        await asyncio.wait_for(task, WAIT_S)
    assert time.monotonic() - t < 2
    return info.value


async def test_the_first_decode_event_is_returned_while_the_push_is_under_way():
    async with Split() as s:
        events = s.events()
        task = s.lease(events)
        await asyncio.sleep(3 * kv_lease.KV_WATCH_S)
        assert not task.done()  # no KV yet, lease holding: it waits
        await s.decode.script.put(worker_pb2.TokenBatch(token_ids=[1, 2]))
        first = await asyncio.wait_for(task, WAIT_S)
        assert list(first.token_ids) == [1, 2]
        # the decode call goes on untouched
        assert not s.decode_call.done() and s.pusher.healthy
        await s.decode.script.put(worker_pb2.TokenBatch(token_ids=[3]))
        assert list((await asyncio.wait_for(anext(events), WAIT_S)).token_ids) == [3]


async def test_a_lease_that_ended_well_no_longer_watches_the_prefill_worker():
    async with Split() as s:
        task = s.lease()
        await s.prefill.script.put(END)  # the push went through
        await asyncio.sleep(3 * kv_lease.KV_WATCH_S)
        s.pusher.healthy = False  # the prefill worker may go now: decode holds the KV
        await asyncio.sleep(3 * kv_lease.KV_WATCH_S)
        assert not task.done()
        await s.decode.script.put(worker_pb2.TokenBatch(token_ids=[5]))
        assert list((await asyncio.wait_for(task, WAIT_S)).token_ids) == [5]
        assert not s.decode_call.done()


@pytest.mark.parametrize(
    ("push_code", "code"),
    [
        ("DEADLINE_EXCEEDED", grpc.StatusCode.UNAVAILABLE),
        ("UNAVAILABLE", grpc.StatusCode.UNAVAILABLE),
        ("CANCELLED", grpc.StatusCode.UNAVAILABLE),
        ("INVALID_ARGUMENT", grpc.StatusCode.INTERNAL),
        ("INTERNAL", grpc.StatusCode.INTERNAL),
    ],
)
async def test_a_failed_push_loses_the_lease_at_once(push_code, code):
    async with Split() as s:
        task = s.lease()
        error = worker_pb2.KvPushError(code=push_code, message="decode worker said no")
        await s.prefill.script.put(worker_pb2.PrefillResponse(kv_push_error=error))
        exc = await lost(task)
        assert exc.code() == code
        assert push_code in exc.details() and "decode worker said no" in exc.details()
        await s.assert_decode_cancelled()
        # a failed push is no worker's fault: both stay in routing
        assert s.pusher.healthy and s.decode_w.healthy


@pytest.mark.parametrize(
    ("status", "pusher_healthy"), [(grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.INTERNAL, True)]
)
async def test_a_broken_prefill_stream_loses_the_lease(status, pusher_healthy):
    async with Split() as s:
        task = s.lease()
        await s.prefill.script.put(status)
        exc = await lost(task)
        assert exc.code() == grpc.StatusCode.UNAVAILABLE  # the request may migrate
        assert f"Prefill stream broke ({status.name})" in exc.details()
        await s.assert_decode_cancelled()
        # the broken call is reported to the pool: UNAVAILABLE takes the prefill worker out of routing
        assert s.pusher.healthy is pusher_healthy
        assert s.decode_w.healthy


async def test_a_prefill_worker_that_dies_loses_the_lease():
    async with Split() as s:
        task = s.lease()
        await s.prefill_server.stop(0)
        exc = await lost(task)
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill worker died" in exc.details()
        await s.assert_decode_cancelled()


async def test_a_prefill_worker_that_stops_answering_polls_loses_the_lease():
    async with Split() as s:
        task = s.lease()
        await asyncio.sleep(2 * kv_lease.KV_WATCH_S)
        assert not task.done()
        s.pusher.healthy = False  # what the stats poller does after failed polls
        exc = await lost(task)
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped answering stats polls" in exc.details()
        await s.assert_decode_cancelled()


async def test_the_request_deadline_ends_the_wait_with_deadline_exceeded():
    async with Split(prefill_timeout=0.5) as s:
        task = s.lease()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(task, WAIT_S)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not isinstance(info.value, LeaseLost)
        await s.assert_decode_cancelled()
        assert s.pusher.healthy


async def test_a_decode_error_before_the_kv_is_raised_as_it_is():
    async with Split() as s:
        task = s.lease()
        await s.decode.script.put(grpc.StatusCode.RESOURCE_EXHAUSTED)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(task, WAIT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not isinstance(info.value, LeaseLost)


async def test_a_prefill_call_cancelled_with_the_request_does_not_lose_the_lease():
    async with Split() as s:
        task = s.lease()
        s.prefill_call.cancel()
        await asyncio.sleep(3 * kv_lease.KV_WATCH_S)
        assert not task.done()
        await s.decode.script.put(worker_pb2.TokenBatch(token_ids=[9]))
        assert list((await asyncio.wait_for(task, WAIT_S)).token_ids) == [9]


async def test_cancelling_the_wait_leaves_no_task_behind():
    async with Split() as s:
        before = asyncio.all_tasks()
        task = s.lease()
        await asyncio.sleep(2 * kv_lease.KV_WATCH_S)
        assert len(asyncio.all_tasks() - before) == 3  # the wait, its first-event task and the lease
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() - before == set()
