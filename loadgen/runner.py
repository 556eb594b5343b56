"""Open-loop load generator over a Backend (pdserve's gRPC API or an OpenAI-compatible server).

Requests are sent on their schedule whether or not earlier ones finished (as in vLLM's
benchmark_serving), so queueing shows up in the latencies instead of throttling the load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.targets import Backend
from pdserve.loadgen.workload import RequestSpec


async def _one(
    backend: Backend, spec: RequestSpec, run_id: str, t0: float, timeout_s: float, temperature: float
) -> RequestRecord:
    sent = time.perf_counter() - t0
    rec = RequestRecord(
        index=spec.index,
        request_id=f"{run_id}-{spec.index}",
        scheduled_s=spec.send_at_s,
        sent_s=sent,
        prompt_tokens=len(spec.prompt_token_ids),
        max_tokens=spec.max_tokens,
        token_times_s=[],
        finish_reason="",
    )
    try:
        await backend.send(spec, rec, t0, timeout_s, temperature)
    except asyncio.CancelledError:
        rec.error = "cancelled: the run was stopped before this request finished"
    return rec


async def run_load(
    backend: Backend,
    specs: Sequence[RequestSpec],
    *,
    run_id: str = "bench",
    request_timeout_s: float = 300.0,
    max_duration_s: float = 600.0,
    temperature: float = 0.0,
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Send ``specs`` to ``backend`` (entered already) on schedule (``send_at_s`` after the start) and
    collect one record each.

    Ends when every request finished, when ``max_duration_s`` seconds passed since the start, or
    when ``stop`` is set (e.g. by Ctrl-C). Requests still in flight then are cancelled (their
    records say so); requests never sent get no record. ``on_record`` sees each record as it ends.
    Every request asks for exactly ``max_tokens`` tokens (``ignore_eos``).
    """
    stop = stop or asyncio.Event()
    records: list[RequestRecord] = []

    def done(task: asyncio.Task) -> None:
        if not task.cancelled():
            records.append(task.result())
            if on_record is not None:
                on_record(task.result())

    t0 = time.perf_counter()
    deadline = t0 + max_duration_s
    tasks: list[asyncio.Task] = []

    async def send_all() -> None:
        for spec in sorted(specs, key=lambda s: s.send_at_s):
            delay = t0 + spec.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(backend, spec, run_id, t0, request_timeout_s, temperature))
            task.add_done_callback(done)
            tasks.append(task)

    sender = asyncio.create_task(send_all())
    stopper = asyncio.create_task(stop.wait())
    while True:
        pending = [t for t in tasks if not t.done()]
        if sender.done() and not pending:
            break
        remaining = deadline - time.perf_counter()
        if remaining <= 0 or stop.is_set():
            break
        # a finished sender must leave the wait set, or every wait returns at once and the loop spins
        # a core until the last request ends, on the machine it measures
        waiting = [stopper, *pending] if sender.done() else [sender, stopper, *pending]
        await asyncio.wait(waiting, timeout=min(remaining, 1.0), return_when=asyncio.FIRST_COMPLETED)
    sender.cancel()
    stopper.cancel()
    for t in tasks:
        t.cancel()  # _one turns the cancellation into a record
    await asyncio.gather(*tasks, return_exceptions=True)
    return sorted(records, key=lambda r: r.index)


async def unloaded_latency(
    backend: Backend, specs: Sequence[RequestSpec], repeats: int = 3, temperature: float = 0.0
) -> tuple[float, float]:
    """Median TTFT and TPOT (seconds) of requests sent one at a time (after one warm-up request).

    Used to derive default SLOs. Raises RuntimeError when every request failed.
    """
    chosen = sorted(specs, key=lambda s: len(s.prompt_token_ids))
    chosen = [chosen[len(chosen) // 2]] * (repeats + 1)
    ttfts, tpots = [], []
    for i, spec in enumerate(chosen):
        rec = await _one(backend, spec, f"unloaded{i}", time.perf_counter(), 300.0, temperature)
        if i and rec.ok:
            ttfts.append(rec.ttft_s)
            if rec.output_tokens > 1:
                tpots.append(rec.tpot_s)
    if not ttfts:
        raise RuntimeError("every unloaded probe request failed")
    ttfts.sort()
    tpots.sort()
    return ttfts[len(ttfts) // 2], (tpots[len(tpots) // 2] if tpots else float("nan"))
