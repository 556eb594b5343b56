"""How the router reaches workers for one request, and the colocated backend.

A backend turns a validated request into a stream of ``WorkerEvent``; the choice is made once,
when the router is built: :class:`~pdserve.router.split_backend.SplitBackend` (prefill pool ->
decode pool) or :class:`ColocatedBackend`.  This module holds what both share: the events and the
per-request state, a worker's token stream as events, the wait for live workers, and
:func:`colocated_stream` (both phases on one worker, which the split backend also uses when a
decode worker prefills a short prompt itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.router.pool import WorkerHandle, WorkerPool
from pdserve.router.token_channel import merged_batches
from pdserve.router.validation import ValidatedRequest
from pdserve.v1 import generate_pb2, worker_pb2

ROUTE_WAIT_S = 10.0  # a new request waits this long (at most its deadline) for a pool that has no live worker


@dataclass
class WorkerEvent:
    """Tokens from a worker; ``finish`` (a FinishReason value) is set on the last one, ``timings``
    on the last one and on any earlier one that knows some phases already."""

    token_ids: list[int]
    finish: int = generate_pb2.FINISH_REASON_UNSPECIFIED
    timings: generate_pb2.Timings | None = None


@dataclass
class RequestState:
    """What Abort needs to stop a request: its open worker calls, and who owns it (the index of
    the API key it came with; None without keys)."""

    calls: list = field(default_factory=list)
    aborted: bool = False
    owner: int | None = None
    shutting_down: bool = False  # the router is stopping: end with an error, not as an abort
    last_token_ns: int = field(default_factory=time.monotonic_ns)  # receipt, then each token message
    stalled: bool = False  # longer than the stall bound without a token (Frontend.watch_stalls)

    def abort(self) -> None:
        self.aborted = True
        self._cancel_calls()

    def shut_down(self) -> None:
        self.shutting_down = True
        self._cancel_calls()

    def _cancel_calls(self) -> None:
        for call in self.calls:
            call.cancel()


async def token_events(
    call, final: Callable[[generate_pb2.Timings], generate_pb2.Timings], channel_queue: asyncio.Queue | None = None
) -> AsyncIterator[WorkerEvent]:
    """A worker's TokenBatch stream as WorkerEvents, in order from the call and, when the request
    named a token channel, that channel's ``channel_queue`` (router/token_channel.py);
    ``final(worker_timings)`` gives the timings of each batch that carries some (the first, with
    the phases known then, and the last). A stream that ends without a final batch raises INTERNAL."""
    async for batch in merged_batches(call, channel_queue):
        timings = final(batch.timings) if batch.HasField("timings") else None
        if batch.finish_reason:
            yield WorkerEvent(list(batch.token_ids), batch.finish_reason, timings)
            return
        yield WorkerEvent(list(batch.token_ids), timings=timings)


def route_wait(timeout: float | None) -> float:
    """How long a new request waits for a live worker: ROUTE_WAIT_S, at most its deadline."""
    return ROUTE_WAIT_S if timeout is None else min(ROUTE_WAIT_S, timeout)


async def wait_for_workers(pool: WorkerPool, wait_s: float) -> bool:
    """Whether every pool has a healthy worker, waiting up to ``wait_s`` for one to come back, or
    longer while the cluster says a worker is being restarted (``WorkerPool.restarting``: a restart
    takes a few seconds, more on a busy machine; until then requests wait here instead of failing)."""
    deadline = time.monotonic() + wait_s
    while pool.roles_without_healthy_worker():
        if time.monotonic() > deadline and not pool.restart_pending():
            return False
        await asyncio.sleep(0.05)
    return True


async def colocated_stream(
    pool: WorkerPool,
    w: WorkerHandle,
    request_id: str,
    prompt: list[int],
    sampling: worker_pb2.ResolvedSampling,
    state: RequestState,
    t0_ns: int,
    timeout: float | None,
    on_decode: bool = False,
) -> AsyncIterator[WorkerEvent]:
    """Both phases of a request on ``w`` through ColocatedService: a colocated worker, or
    (``on_decode``) a decode worker prefilling a short prompt itself."""
    n = len(prompt)
    w.outstanding_prefill_tokens += n
    w.active_requests += 1
    w.routed(n + 1)
    t_send = time.monotonic_ns()
    channel_queue = w.tokens.subscribe(request_id)
    call = w.colocated.Generate(
        worker_pb2.ColocatedRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            token_channel=w.tokens.channel_id if channel_queue is not None else "",
        ),
        timeout=timeout,
    )
    state.calls.append(call)
    prefilled = False
    produced: list[int] = []

    def final(worker: generate_pb2.Timings) -> generate_pb2.Timings:
        timings = generate_pb2.Timings()
        timings.CopyFrom(worker)
        timings.queue_ns += t_send - t0_ns
        timings.router_queue_ns = t_send - t0_ns
        timings.prefilled_on_decode = on_decode
        return timings

    try:
        async for ev in token_events(call, final, channel_queue):
            if not prefilled:
                prefilled = True
                w.outstanding_prefill_tokens -= n
            produced += ev.token_ids
            yield ev
    except grpc.aio.AioRpcError as exc:
        pool.call_failed(w, exc)
        raise
    finally:
        call.cancel()
        w.tokens.unsubscribe(request_id)
        if not prefilled:
            w.outstanding_prefill_tokens -= n
        w.active_requests -= 1
        pool.served(w, prompt + produced[:-1])  # the last token's KV is never written


class ColocatedBackend:
    """One worker of the colocated pool runs both phases."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    async def stream(
        self, req: ValidatedRequest, state: RequestState, t0_ns: int, timeout: float | None
    ) -> AsyncIterator[WorkerEvent]:
        await wait_for_workers(self.pool, route_wait(timeout))
        prompt = list(req.prompt_token_ids)
        w = self.pool.pick_colocated(len(prompt), self.pool.prefix_of(prompt))
        async for ev in colocated_stream(self.pool, w, req.request_id, prompt, req.sampling, state, t0_ns, timeout):
            yield ev
