"""run_load waits for its requests without spinning: the load generator shares the machine it measures."""

from __future__ import annotations

import asyncio

from pdserve.loadgen import runner
from pdserve.loadgen.workload import RequestSpec


class SlowBackend:
    """Each request takes ``seconds`` and then reads its tokens."""

    name = "openai"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def send(self, spec, rec, t0, timeout_s, temperature) -> None:
        await asyncio.sleep(self.seconds)
        rec.token_times_s = [0.0] * spec.max_tokens
        rec.finish_reason = "length"


async def test_the_loop_wakes_once_a_request_after_the_last_send(monkeypatch):
    """Three requests sent at once, each taking 0.4 s: after the sender ends, run_load wakes when a
    request ends (or once a second), not on every turn of the event loop (it woke thousands of
    times when the finished sender stayed in its wait set)."""
    calls = []
    wait = asyncio.wait

    async def counted(*args, **kwargs):
        calls.append(1)
        return await wait(*args, **kwargs)

    monkeypatch.setattr(runner.asyncio, "wait", counted)
    specs = [RequestSpec(i, 0.0, (1, 2, 3), 2, "random") for i in range(3)]
    records = await runner.run_load(SlowBackend(0.4), specs)
    assert [r.output_tokens for r in records] == [2, 2, 2]
    assert len(calls) <= 5, f"run_load woke {len(calls)} times for 3 requests"
