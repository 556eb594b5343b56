"""The split backend: prefill on a worker of the prefill pool, decode on one of the decode pool.

:class:`SplitBackend` routes one request to a prefill worker and a decode worker, moves the request
to live workers when one of them is lost mid-stream (migration), and lets the decode worker prefill
a prompt itself when it already holds all but a few of its tokens (conditional disaggregation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.router.backends import (
    RequestState,
    WorkerEvent,
    colocated_stream,
    route_wait,
    token_events,
    wait_for_workers,
)
from pdserve.router.kv_lease import LeaseLost, first_while_leased
from pdserve.router.local_prefill import LocalPrefill, local_prefill_reason
from pdserve.router.pool import WorkerPool
from pdserve.router.validation import ValidatedRequest
from pdserve.v1 import generate_pb2, worker_pb2

KV_TIMEOUT_S = 300.0  # decode's last-resort wait for a KV; a lost KV lease (kv_lease.py) ends it at once instead
MAX_MIGRATIONS = 2  # per request
MIGRATION_WAIT_S = 4.0  # for a live worker to appear; an unsavable stream still ends within ~5 s
CACHED_TOKENS_KEY = "x-pdserve-cached-tokens"  # decode_worker/worker.py: prompt tokens it holds for the KV
log = logging.getLogger(__name__)


def _worker_lost(exc: grpc.aio.AioRpcError) -> bool:
    """A worker went away or a KV push could not reach decode (UNAVAILABLE), or decode's wait
    for the KV ran out."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE or (
        exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no KV cache arrived" in (exc.details() or "")
    )


class SplitBackend:
    """Prefill on one worker of the prefill pool, decode on one of the decode pool (docs/architecture.md,
    "Life of a request").

    **Migration** (as NVIDIA Dynamo does it): when the decode worker becomes unreachable
    (UNAVAILABLE) mid-stream, the request is prefilled again on a live prefill worker with its
    prompt plus every token already streamed, and continues on a live decode worker; the sampler's
    step index continues too (``step_offset``), so the client's stream goes on with no duplicated
    or missing token and greedy or seeded output equals an undisturbed run. A prefill worker that
    dies before the first token, or a KV lease lost before decode has the KV (kv_lease.py: its
    prefill worker died, or its push could not reach decode), is retried the same way; a push that
    failed otherwise ends the stream with an error naming the cause. Each request migrates at most
    ``MAX_MIGRATIONS`` times, waiting up to ``MIGRATION_WAIT_S`` for live workers; then the
    original error ends the stream.

    **Conditional disaggregation** (router/local_prefill.py): when ``local_prefill`` says so (the
    uncached part is short, or the prefill pool is busy and the decode worker has room), the decode
    worker prefills the prompt itself and no KV moves; ``on_local_prefill(reason)`` is called and
    the request's timings say so (``prefilled_on_decode``). Default: never.
    """

    def __init__(
        self,
        pool: WorkerPool,
        on_migrate: Callable[[], None] | None = None,
        local_prefill: LocalPrefill | None = None,
        on_local_prefill: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.on_migrate = on_migrate or (lambda: None)
        self.local_prefill = local_prefill or LocalPrefill(tokens=0, policy="prefix")
        self.on_local_prefill = on_local_prefill or (lambda reason: None)

    async def stream(
        self, req: ValidatedRequest, state: RequestState, t0_ns: int, timeout: float | None
    ) -> AsyncIterator[WorkerEvent]:
        produced: list[int] = []
        for attempt in range(MAX_MIGRATIONS + 1):
            try:
                async for ev in self._attempt(req, produced, attempt, state, t0_ns, timeout):
                    produced += ev.token_ids
                    yield ev
                return
            except grpc.aio.AioRpcError as exc:
                if (
                    not _worker_lost(exc)
                    or state.aborted
                    or attempt == MAX_MIGRATIONS
                    or not await wait_for_workers(self.pool, MIGRATION_WAIT_S)
                ):
                    raise
                log.warning(
                    "request %s: %s after %d tokens; migrating it (attempt %d)",
                    req.request_id,
                    exc.details(),
                    len(produced),
                    attempt + 1,
                )
                self.on_migrate()

    async def _attempt(
        self,
        req: ValidatedRequest,
        produced: list[int],
        attempt: int,
        state: RequestState,
        t0_ns: int,
        timeout: float | None,
    ) -> AsyncIterator[WorkerEvent]:
        """One prefill + decode pass over the prompt and the ``produced`` tokens so far."""
        sampling = worker_pb2.ResolvedSampling()
        sampling.CopyFrom(req.sampling)
        sampling.max_tokens -= len(produced)
        sampling.step_offset += len(produced)
        if sampling.max_tokens == 0:  # every token arrived, only the final message was lost
            yield WorkerEvent([], generate_pb2.FINISH_REASON_LENGTH, generate_pb2.Timings())
            return
        prompt = list(req.prompt_token_ids) + produced
        request_id = req.request_id if attempt == 0 else f"{req.request_id}#migrated{attempt}"
        await wait_for_workers(self.pool, route_wait(timeout))
        n, hashes = len(prompt), self.pool.prefix_of(prompt)
        decode_w = self.pool.pick_decode(n, hashes)
        reason = local_prefill_reason(self.pool, decode_w, n, hashes, self.local_prefill)
        if reason is not None:
            self.on_local_prefill(reason)
            async for ev in colocated_stream(
                self.pool, decode_w, request_id, prompt, sampling, state, t0_ns, timeout, on_decode=True
            ):
                yield ev
            return
        prefill_w = self.pool.pick_prefill(n, hashes)
        self.pool.served(prefill_w, prompt)
        self.pool.served(decode_w, prompt)
        prefill_w.outstanding_prefill_tokens += n
        prefill_w.active_requests += 1
        decode_w.active_requests += 1
        decode_w.routed(n + 1)
        channel_queue = decode_w.tokens.subscribe(request_id)
        decode_call = decode_w.decode.Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                kv_timeout_s=KV_TIMEOUT_S,
                prompt_token_ids=prompt,
                token_channel=decode_w.tokens.channel_id if channel_queue is not None else "",
            ),
            timeout=timeout,
        )
        state.calls.append(decode_call)
        current, prefill_call = decode_w, None  # whose call a failure comes from
        try:
            # the decode worker now waits for this request's KV, holding the prefix it has cached
            held = dict(await decode_call.initial_metadata()).get(CACHED_TOKENS_KEY, "0")
            t_prefill = time.monotonic_ns()
            prefill_call = prefill_w.prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    decode_address=decode_w.address,
                    kv_skip_tokens=int(held),
                ),
                timeout=timeout,
            )
            state.calls.append(prefill_call)
            try:
                current = prefill_w
                first = await prefill_call.read()
                if first is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.INTERNAL,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        "prefill stream ended without its first token",
                    )
                current = decode_w
            finally:
                prefill_w.outstanding_prefill_tokens -= n
                prefill_w.active_requests -= 1
            timings = generate_pb2.Timings(
                queue_ns=t_prefill - t0_ns + first.queue_ns,
                prefill_ns=first.prefill_ns,
                cached_prompt_tokens=first.cached_prompt_tokens,
                router_queue_ns=t_prefill - t0_ns,
            )
            if first.finish_reason:
                yield WorkerEvent([first.first_token], first.finish_reason, timings)
                return
            yield WorkerEvent([first.first_token], timings=timings)  # queue and prefill are known now

            def final(worker: generate_pb2.Timings) -> generate_pb2.Timings:
                timings.kv_transfer_ns, timings.decode_ns = worker.kv_transfer_ns, worker.decode_ns
                timings.kv_transfer_bytes, timings.kv_admission_ns = worker.kv_transfer_bytes, worker.kv_admission_ns
                timings.num_preemptions, timings.preempted_ns = worker.num_preemptions, worker.preempted_ns
                return timings

            events = token_events(decode_call, final, channel_queue)
            # until decode has the KV (its first event), the prefill call that pushes it holds the lease
            yield await first_while_leased(events, decode_call, prefill_call, prefill_w, self.pool)
            async for ev in events:
                yield ev
        except grpc.aio.AioRpcError as exc:
            if not isinstance(exc, LeaseLost):
                self.pool.call_failed(current, exc)
            raise
        finally:
            decode_call.cancel()
            decode_w.tokens.unsubscribe(request_id)
            if prefill_call is not None:
                prefill_call.cancel()  # a push under way goes on (the prefill worker shields it)
            decode_w.active_requests -= 1
