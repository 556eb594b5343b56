"""Per-request token streams between the engine thread and the gRPC handlers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestStreams:
    """Per-request asyncio queues fed from any thread (the engine thread puts, handlers get)."""

    loop: asyncio.AbstractEventLoop
    _queues: dict[str, asyncio.Queue] = field(default_factory=dict)

    def open(self, request_id: str) -> asyncio.Queue:
        """New queue for ``request_id``; ValueError when that id is already in flight here."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight on this worker")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def put(self, request_id: str, event: Any) -> None:
        """Deliver ``event`` to the request's queue; thread-safe; dropped if the stream is closed."""
        self.loop.call_soon_threadsafe(self._put, request_id, event)

    def put_many(self, events: list[tuple[str, Any]]) -> None:
        """Deliver a step's ``(request_id, event)`` pairs in one hand-off to the event loop (one
        wake-up per step, not one per token); thread-safe; events of closed streams are dropped."""
        if events:
            self.loop.call_soon_threadsafe(self._put_many, events)

    def _put(self, request_id: str, event: Any) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(event)

    def _put_many(self, events: list[tuple[str, Any]]) -> None:
        for request_id, event in events:
            self._put(request_id, event)

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)


async def drain(q: asyncio.Queue) -> list[Any]:
    """Wait for one item, then take every item already queued (coalesces tokens into one message)."""
    items = [await q.get()]
    while not q.empty():
        items.append(q.get_nowait())
    return items
