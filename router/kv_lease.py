"""The KV lease of a split request: from the start of its prefill until its decode worker holds
its KV, the Prefill call that pushes the KV stays open, and the router watches that call and the
prefill worker's health. A lease that ends without the KV ends the decode wait at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc

from pdserve.v1 import worker_pb2

KV_WATCH_S = 0.1  # how often the router checks the pushing prefill worker's health while decode waits
TRANSPORT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")  # the decode worker was not reached in time
log = logging.getLogger(__name__)
T = TypeVar("T")


class LeaseLost(grpc.aio.AioRpcError):
    """The KV will not reach the decode worker: its prefill worker died, or reported a failed push.

    Raised instead of the decode call's own error, though it is no fault of the decode worker: no
    worker leaves routing for it. UNAVAILABLE ones migrate (docs/architecture.md, "When a worker dies").
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def push_failed(error: worker_pb2.KvPushError) -> LeaseLost:
    """The error for a push the prefill worker reports failed: UNAVAILABLE (the request may
    migrate) when the decode worker could not be reached in time, else INTERNAL (a refusal or a
    misconfigured cluster: another try would fail alike); the push's own code is in the details."""
    code = grpc.StatusCode.UNAVAILABLE if error.code in TRANSPORT_CODES else grpc.StatusCode.INTERNAL
    return LeaseLost(code, f"the KV cache did not reach the decode worker: {error.code}: {error.message}")


async def _lease(prefill_call) -> None:
    """Read the rest of a Prefill stream (after its first message): returns when the push went
    through; LeaseLost when the worker reports a failed push; the call's AioRpcError when it breaks."""
    while (msg := await prefill_call.read()) is not grpc.aio.EOF:
        if msg.HasField("kv_push_error"):
            raise push_failed(msg.kv_push_error)


async def first_while_leased(events: AsyncIterator[T], decode_call, prefill_call, pusher, pool) -> T:
    """The decode stream's first event (its KV is in), while the lease holds.

    The lease holds until the Prefill stream ends well. It is lost, the decode call cancelled and
    LeaseLost raised at once, when that stream reports a failed push or breaks, or when the
    prefill worker ``pusher`` (a WorkerHandle of ``pool``) stops answering its stats polls first;
    when the request's deadline ends the stream, its DEADLINE_EXCEEDED is raised.
    """
    first = asyncio.ensure_future(anext(events))
    lease = asyncio.ensure_future(_lease(prefill_call))
    try:
        while True:
            await asyncio.wait(
                [first] if lease.done() else [first, lease], timeout=KV_WATCH_S, return_when=asyncio.FIRST_COMPLETED
            )
            if first.done():
                return first.result()
            lost = _lost(lease, pusher, pool)
            if lost is not None:
                decode_call.cancel()
                raise lost
    finally:
        for task in (first, lease):
            if not task.done():
                task.cancel()
        await asyncio.gather(first, lease, return_exceptions=True)


def _lost(lease: asyncio.Future, pusher, pool) -> grpc.aio.AioRpcError | None:
    """Why the lease is lost (LeaseLost, or the Prefill call's DEADLINE_EXCEEDED: the request's own
    deadline passed), or None while it holds, after it ended well or was cancelled with the request."""
    if lease.done():
        exc = None if lease.cancelled() else lease.exception()
        if exc is None or isinstance(exc, LeaseLost) or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return exc
        pool.call_failed(pusher, exc)
        why = f"its Prefill stream broke ({exc.code().name})"
    elif not pusher.healthy:
        why = "it stopped answering stats polls"
    else:
        return None
    log.warning("prefill worker %s lost before its KV reached decode: %s", pusher.address, why)
    # a dead worker and a cut link look alike from here: say what was seen
    return LeaseLost(
        grpc.StatusCode.UNAVAILABLE,
        f"the prefill worker died before its KV reached decode (or the router lost it: {why})",
    )
