"""RequestStreams (per-request queues fed from the engine thread) and drain (coalescing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.worker.streams import RequestStreams, drain

WAIT_S = 5


def put_from_thread(streams: RequestStreams, events: list[tuple[str, object]]) -> None:
    """Put ``events`` from a thread of its own, as the engine thread does, and wait for it."""
    t = threading.Thread(target=lambda: [streams.put(rid, ev) for rid, ev in events])
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive()


async def settle(streams: RequestStreams) -> None:
    """Return once every put already made from this thread has run on the loop (callbacks run in order)."""
    marker = "settle-marker"
    q = streams.open(marker)
    streams.put(marker, None)
    await asyncio.wait_for(q.get(), WAIT_S)
    streams.close(marker)


async def test_events_put_from_another_thread_arrive_in_order_on_their_own_stream():
    streams = RequestStreams(asyncio.get_running_loop())
    a, b = streams.open("a"), streams.open("b")
    put_from_thread(streams, [("a", i) if i % 3 else ("b", i) for i in range(60)])
    await settle(streams)
    assert [a.get_nowait() for _ in range(a.qsize())] == [i for i in range(60) if i % 3]
    assert [b.get_nowait() for _ in range(b.qsize())] == [i for i in range(60) if not i % 3]


async def test_open_refuses_an_id_in_flight_until_it_is_closed():
    streams = RequestStreams(asyncio.get_running_loop())
    first = streams.open("r1")
    with pytest.raises(ValueError, match="'r1' is already in flight"):
        streams.open("r1")
    streams.open("r2")  # another id is fine
    streams.close("r1")
    streams.close("r1")  # closing twice (or an unknown id) is harmless
    streams.close("never-opened")
    second = streams.open("r1")
    assert second is not first
    streams.put("r1", "x")
    assert await asyncio.wait_for(second.get(), WAIT_S) == "x"
    assert first.empty()


async def test_a_put_after_close_is_dropped():
    streams = RequestStreams(asyncio.get_running_loop())
    q = streams.open("r")
    put_from_thread(streams, [("r", "before")])
    await settle(streams)
    streams.close("r")
    put_from_thread(streams, [("r", "after"), ("unknown", "nobody listens")])
    streams.put("r", "after, from the loop")
    await settle(streams)
    assert q.qsize() == 1 and q.get_nowait() == "before"


async def test_drain_waits_for_one_item_then_takes_every_queued_one():
    q: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(drain(q))
    await asyncio.sleep(0.05)
    assert not task.done()  # nothing queued: it waits
    for i in range(3):
        q.put_nowait(i)
    assert await asyncio.wait_for(task, WAIT_S) == [0, 1, 2]
    assert q.empty()
    q.put_nowait("one")
    assert await asyncio.wait_for(drain(q), WAIT_S) == ["one"]


async def test_drain_coalesces_what_the_engine_thread_put_while_the_loop_was_busy():
    streams = RequestStreams(asyncio.get_running_loop())
    q = streams.open("r")
    # the loop is blocked while the thread puts (join), so all five arrive before drain resumes
    put_from_thread(streams, [("r", t) for t in (11, 12, 13, 14, 15)])
    assert await asyncio.wait_for(drain(q), WAIT_S) == [11, 12, 13, 14, 15]
    put_from_thread(streams, [("r", 16)])
    assert await asyncio.wait_for(drain(q), WAIT_S) == [16]
    assert q.empty()
