"""The router's end of the token channels (worker/token_channel.py): one stream per worker that
brings the middle tokens of every request the router sent there, one message a step.

:class:`TokenChannelClient` reads a worker's channel and hands each entry to the queue of its
request; :func:`merged_batches` gives a request's batches in order from its call (first and last
batch, errors) and that queue (the rest). A channel that closes fails every request that used it
with UNAVAILABLE, the code a lost worker gives, so the split backend migrates them as it does when
a worker dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import worker_pb2

ROUTER_CHANNEL_ID = uuid.uuid4().hex  # this router process's id on every worker's token channels
REOPEN_AFTER_S = 1.0  # a channel that closed is opened again by a request at least this long after
log = logging.getLogger(__name__)
_CALL_ENDED = object()


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class TokenChannelClient:
    """A worker's token channel as the router holds it.

    ``subscribe(request_id)`` before sending a request returns the queue its channel batches will
    reach, or None while the channel is not open (the request then names no channel and gets every
    batch on its call); the first call opens it in the background.
    """

    def __init__(self, stub, address: str, channel_id: str = ROUTER_CHANNEL_ID) -> None:
        self.stub = stub
        self.address = address
        self.channel_id = channel_id
        self.ready = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None
        self._closed_at = float("-inf")

    def subscribe(self, request_id: str) -> asyncio.Queue | None:
        if not self.ready:
            self._open()
            return None
        q = self._queues[request_id] = asyncio.Queue()
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _open(self) -> None:
        if self._task is None and time.monotonic() - self._closed_at >= REOPEN_AFTER_S:
            self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        call = self.stub.TokenChannel(worker_pb2.TokenChannelRequest(channel_id=self.channel_id))
        reason = "it ended"
        try:
            async for batch in call:
                self.ready = True
                for entry in batch.requests:
                    q = self._queues.get(entry.request_id)
                    if q is not None:
                        q.put_nowait((entry.first_index, list(entry.token_ids), None))
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the router closed it"
        finally:
            call.cancel()
            self.ready, self._task, self._closed_at = False, None, time.monotonic()
            if self._queues:
                log.warning(
                    "token channel from %s closed (%s); its %d requests fail", self.address, reason, len(self._queues)
                )
            error = _unavailable(f"token channel from worker {self.address} closed: {reason}")
            for q in self._queues.values():
                q.put_nowait(error)
            self._queues.clear()

    async def close(self) -> None:
        """Stop reading (router shutdown, or the worker replaced); its requests fail as above."""
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.ready, self._task = False, None  # also when it was cancelled before it began


async def merged_batches(call, q: asyncio.Queue | None) -> AsyncIterator[worker_pb2.TokenBatch]:
    """A request's TokenBatches in order: from ``call`` alone when ``q`` is None, else from the call
    and the channel queue ``q``, ordered by ``first_index``. Raises what the call or the channel
    raised (CancelledError once the call is cancelled); INTERNAL when the call ends without a last
    batch."""
    if q is None:
        async for batch in call:
            yield batch
            if batch.finish_reason:
                return
        raise _ended()

    async def read_call() -> None:
        try:
            async for batch in call:
                q.put_nowait((batch.first_index, None, batch))
            q.put_nowait(_CALL_ENDED)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            q.put_nowait(exc)  # CancelledError: the call was cancelled (an abort), as a plain call raises

    reader = asyncio.get_running_loop().create_task(read_call())
    try:
        pending: dict[int, tuple] = {}
        next_index, last_seen = 0, False
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item is _CALL_ENDED:
                if last_seen:
                    continue
                raise _ended()
            first, tokens, batch = item
            last_seen = last_seen or (batch is not None and bool(batch.finish_reason))
            pending[first] = (tokens, batch)
            while next_index in pending:
                tokens, batch = pending.pop(next_index)
                if batch is None:
                    batch = worker_pb2.TokenBatch(token_ids=tokens, first_index=next_index)
                next_index += len(batch.token_ids)
                yield batch
                if batch.finish_reason:
                    return
    finally:
        reader.cancel()


def _ended() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "worker stream ended without a final message",
    )
