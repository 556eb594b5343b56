"""A discrete-event simulation of a pdserve cluster on a virtual clock, running pdserve's own
scheduling code: each worker is a real ``LLMEngine`` on a ``VirtualRunner`` (its steps take the
profile's predicted time), routing is ``WorkerPool``'s policies on handles without channels, the
router's local-prefill rule (``local_prefill_reason``) decides which requests the decode worker
prefills itself, and with ``placement="auto"`` the router's ``RoleRebalancer`` switches the
switchable workers' roles (planner/sim_roles.py).

The serving path (``ServingPaths``, the profile's ``serving`` fits): a request prefilled where it
decodes pays the colocated path's costs, one prefilled on a prefill worker the split path's; a
colocated or decode worker's steps pay their path's ``step_extra_s``, a prefill worker's none, and
each step takes ``ServingPaths.step_factors`` times the engine's predicted time. A prefill worker's
core also sends its KV hand-offs (``SimWorker.send_kv``), so a step that starts while they run
takes the rest of them longer (``SimWorker.sending_left``).

Events (a heap of virtual times): arrivals at their send times plus the router's time for a new
request (``ServingModel.r0``); a worker's step, which runs ``LLMEngine.step`` and ends after the
predicted time plus the serving path's (``ServingModel.step_extra_s``), stretched while the workers,
router and clients want more than ``host_cores`` (``HostCpu``), its tokens then relayed to the
client (``ServingModel.r1``, ``relay_s``; a first token also ``f0``); a KV hand-off reaching its
decode worker after ``StepModel.handoff_s`` of its bytes (``admit_kv``, retried and then preempting
as the decode worker does); a split request's prefill starting once its decode worker has held its
prefix, which that worker's engine does between two steps (the real ``Decode`` call waits for it
before the router sends the prompt to prefill); a stats poll every ``STATS_INTERVAL_S``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from pdserve.decode_worker.worker import ADMIT_PREEMPT_AFTER_S, ADMIT_RETRY_S
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.codec import KvPayload
from pdserve.engine.llm_engine import KvCacheFullError, StepOutput
from pdserve.engine.params import SamplingParams
from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.prefix_cache import WorkerPrefixCounters
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.host_cpu import HostCpu, ServingModel, ServingPaths
from pdserve.planner.sim_roles import SimRoles
from pdserve.planner.sim_worker import SimRequest, SimWorker
from pdserve.planner.step_model import StepModel
from pdserve.router.local_prefill import LocalPrefill, local_prefill_reason
from pdserve.router.pool import STATS_INTERVAL_S, Overloaded, WorkerPool
from pdserve.router.split_backend import KV_TIMEOUT_S
from pdserve.v1 import worker_pb2

ARRIVE, STEP, KV, PREFILL = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    """A cluster as ``pdserve serve`` would start it: ``engine`` before the roles' defaults
    (``for_role``), worker counts (colocated: ``num_prefill + num_decode`` workers; auto: the first
    roles), routing, the local-prefill rule (tokens, policy), the request bound per worker, the
    router's relay of each token to the client (seconds) beyond the profile's, auto's TTFT and TPOT
    targets (seconds), and the cores the workers share with the router and the load generator
    (``host_cores``, ``HostCpu``; 0: none shared)."""

    engine: EngineConfig
    placement: str = "split"
    num_prefill: int = 1
    num_decode: int = 1
    routing: str = "prefix-aware"
    local_prefill_tokens: int = 0
    max_requests_per_worker: int = 0
    relay_s: float = 0.0
    local_prefill_policy: str = "prefix"
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    host_cores: float = 0.0


class Simulator:
    """Runs request specs through a simulated cluster (``SimConfig``) whose steps take
    ``model``'s predicted time for the profile's ``dtype``, plus the serving path's (``serving``, the
    profile's ``ServingPaths``; one ``ServingModel`` for both paths; None: the engine's steps only).
    ValueError for a model that cannot load."""

    def __init__(
        self, cfg: SimConfig, model: StepModel, dtype: str, serving: ServingModel | ServingPaths | None = None
    ) -> None:
        self.cfg, self.model = cfg, model
        self.paths = ServingPaths.of(serving)
        self.serving = self.paths.colocated if cfg.placement == "colocated" else self.paths.split  # the router's
        self.host, self.threads = HostCpu(cfg.host_cores), cfg.engine.torch_threads or 1
        roles = (
            [("colocated", cfg.num_prefill + cfg.num_decode)]
            if cfg.placement == "colocated"
            else [("prefill", cfg.num_prefill), ("decode", cfg.num_decode)]
        )
        auto = cfg.placement == "auto"
        self.workers = [SimWorker(r, i, cfg.engine, model, dtype, auto) for r, k in roles for i in range(k)]
        for w in self.workers:
            self.set_role(w, w.role)
        self.by_address = {w.handle.address: w for w in self.workers}
        self.pool = WorkerPool([], [], [], cfg.max_requests_per_worker, cfg.routing)
        self.pool.workers = [w.handle for w in self.workers]
        self.max_model_len = min(w.engine.max_model_len for w in self.workers)
        self.tokenizer = self.workers[0].engine.tokenizer
        self._heap, self._seq, self._next_poll = [], itertools.count(), 0.0
        self.requests: dict[str, SimRequest] = {}
        self.local_prefill = LocalPrefill(cfg.local_prefill_tokens, cfg.local_prefill_policy)
        self.roles = SimRoles(self, cfg.slo_ttft_s, cfg.slo_tpot_s) if auto else None

    def set_role(self, w: SimWorker, role: str) -> None:
        """Give ``w`` ``role`` and its path's ``step_extra_s``; every worker its ``step_factors`` (with
        no prefill worker left, the decode workers prefill their own prompts, as colocated ones)."""
        w.role, w.handle.role, w.path = role, role, self.paths.split if role != "colocated" else self.paths.colocated
        local = not any(x.role == "prefill" for x in self.workers)
        for x in self.workers:
            x.engine.runner.factors = self.paths.step_factors(x.role, local)

    # -- the event loop -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def run(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        """Every spec sent at its ``send_at_s`` (ignore_eos, ``max_tokens`` tokens); returns one
        record per spec, times in virtual seconds from the start. A request a worker refuses
        (too long, over the bound) or that never finishes gets an ``error``."""
        for spec in specs:
            self._push(spec.send_at_s + self.serving.r0, ARRIVE, spec)
        while self._heap:
            t, _, kind, obj = heapq.heappop(self._heap)
            if t >= self._next_poll:
                self._poll(t)
            if kind == ARRIVE:
                self._arrive(t, obj)
            elif kind == STEP:
                self._step(t, obj)
            elif kind == PREFILL:
                self._start_prefill(t, obj)
            else:
                self._admit(t, *obj)
        for r in self.requests.values():
            if not r.rec.finish_reason and not r.rec.error:
                r.rec.error = "did not finish: no worker could schedule it (KV cache too small?)"
        return [self.requests[f"sim-{s.index}"].rec for s in specs]

    def _poll(self, t: float) -> None:
        """The router's stats poll (``WorkerPool.refresh``) of every worker, at the last tick <= t."""
        for w in self.workers:  # what GetStats would answer, taken as the pool takes it
            s = w.engine.stats()
            stats = worker_pb2.WorkerStats(**s, num_awaiting_kv=w.awaiting_kv, switchable=w.handle.switchable)
            w.handle.apply_stats(stats)
        if self.roles is not None:
            self.roles.tick(t)
        self._next_poll = (math.floor(t / STATS_INTERVAL_S) + 1) * STATS_INTERVAL_S

    def _wake(self, w: SimWorker, t: float) -> None:
        if not w.busy:
            w.busy = True
            self._push(t, STEP, w)

    def _step(self, t: float, w: SimWorker) -> None:
        """The step that ends at ``t`` hands out its tokens; the next one starts if there is work."""
        outputs, w.outputs = w.outputs, []
        for out in outputs:
            self._output(t, w, out)
        steps = w.engine.runner.num_steps
        w.clock.now_s = t
        if w.engine.has_work():
            busy = sum(x.busy for x in self.workers) * self.threads  # this worker's threads among them
            w.engine.runner.neighbours_busy = bool(self.host.cores) and busy > self.threads
            w.outputs = w.engine.step()
            extra = w.sending_left(t) if w.role == "prefill" else w.path.step_extra_s(len(w.outputs))
            if w.outputs:  # the step's message to the router
                self.host.charge_router(t, w.path.cpu_s[1])
            w.clock.now_s = t + (w.clock.now_s - t + extra) * self.host.stretch(t, busy)
        if w.engine.runner.num_steps == steps:  # nothing could run: wait for new work
            w.busy = False
        else:
            self._push(w.clock.now_s, STEP, w)

    # -- one request ----------------------------------------------------------------------------
    def _arrive(self, t: float, spec: RequestSpec) -> None:
        rid, prompt = f"sim-{spec.index}", list(spec.prompt_token_ids)
        rec = RequestRecord(
            index=spec.index,
            request_id=rid,
            scheduled_s=spec.send_at_s,
            sent_s=spec.send_at_s,
            prompt_tokens=len(prompt),
            max_tokens=spec.max_tokens,
            token_times_s=[],
        )
        r = self.requests[rid] = SimRequest(spec, rec)
        self.host.charge_router(t, self.serving.cpu_s[0])
        sampling = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
        n, hashes, pool = len(prompt), self.pool.prefix_of(prompt), self.pool
        try:
            if self.cfg.placement == "colocated":
                r.worker = self.by_address[pool.pick_colocated(n, hashes).address]
            else:
                r.decode = self.by_address[pool.pick_decode(n, hashes).address]
                if local_prefill_reason(pool, r.decode.handle, n, hashes, self.local_prefill) is not None:
                    r.worker, r.decode, rec.prefilled_on_decode = r.decode, None, True
                else:
                    r.worker = self.by_address[pool.pick_prefill(n, hashes).address]
            r.worker.engine.check_request(prompt, sampling)
        except (Overloaded, ValueError) as exc:
            rec.error = str(exc)
            return
        w = r.worker.handle
        w.outstanding_prefill_tokens += n
        w.active_requests += 1
        if rec.prefilled_on_decode:  # router/backends.py colocated_stream
            w.routed(n + 1)
        if r.decode is not None:  # SplitBackend: index both, count decode's request and blocks
            pool.served(w, prompt)
            pool.served(r.decode.handle, prompt)
            r.decode.handle.active_requests += 1
            r.decode.handle.routed(n + 1)
            r.held = r.decode.engine.pin_prefix(rid, prompt)
            r.decode.awaiting_kv += 1
            if r.decode.busy and r.decode.clock.now_s > t:  # the pin runs between the decode worker's steps
                self._push(r.decode.clock.now_s, PREFILL, r)
                return
        self._start_prefill(t, r)

    def _start_prefill(self, t: float, r: SimRequest) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=r.spec.max_tokens, ignore_eos=True)
        r.worker.engine.add_request(r.rec.request_id, list(r.spec.prompt_token_ids), sampling)
        self._wake(r.worker, t)

    def _output(self, t: float, w: SimWorker, out: StepOutput) -> None:
        seq, r = out.seq, self.requests[out.seq.request_id]
        path = self.paths.split if r.decode is not None else self.paths.colocated
        self.host.charge_router(t, path.cpu_s[2])
        first = path.f0 if not r.rec.token_times_s else 0.0
        r.rec.token_times_s.append(t + self.cfg.relay_s + first + path.r1 * self.host.stretch(t, 0))
        r.output.append(out.token)
        if out.prefill and len(r.rec.token_times_s) == 1:  # a recompute after preemption is no first token
            r.worker.handle.outstanding_prefill_tokens -= seq.num_prompt_tokens
            r.rec.queue_s = seq.prefill_start_ns / 1e9 - r.rec.sent_s
            r.rec.prefill_s = (seq.prefill_end_ns - seq.prefill_start_ns) / 1e9
            r.rec.cached_prompt_tokens = seq.num_cached_tokens
            r.prefill_end_s = t
        if r.decode is not None and w is r.worker:  # a prefill for another worker: hand the KV off
            w.handle.active_requests -= 1
            if seq.is_finished:  # one token only: nothing to hand off
                r.decode.awaiting_kv -= 1
                r.decode.engine.unpin(seq.request_id)
                self._finish(t, r, seq.finish_reason.value, r.decode)
            else:
                payload = w.engine.extract_kv(seq, skip_tokens=r.held)
                r.rec.kv_transfer_bytes = payload.kv.nbytes
                self._push(t + w.send_kv(t, self.model.handoff_s(payload.kv.nbytes)), KV, (r, payload))
        elif seq.is_finished:
            if r.decode is None:  # colocated, or prefilled on decode: served when it ends
                self.pool.served(w.handle, list(r.spec.prompt_token_ids) + r.output[:-1])
            self._finish(t, r, seq.finish_reason.value, w)

    def _finish(self, t: float, r: SimRequest, reason: str, w: SimWorker) -> None:
        r.rec.finish_reason = reason
        w.handle.active_requests -= 1
        times = r.rec.token_times_s
        if self.roles is not None and times:
            tpot = (times[-1] - times[0]) / (len(times) - 1) * 1e9 if len(times) > 1 else None
            self.roles.rebalancer.observe_request((times[0] - r.rec.sent_s) * 1e9, tpot, t)
        if r.decode is not None:
            r.rec.decode_s = t - (r.prefill_end_s + r.rec.kv_transfer_s)

    def _admit(self, t: float, r: SimRequest, payload: KvPayload) -> None:
        """A KV reaching its decode worker: admitted, or retried while the cache is full (after
        ``ADMIT_PREEMPT_AFTER_S``, by preempting), as ``DecodeWorker.admit`` does."""
        if math.isnan(r.kv_first_try_s):
            r.kv_first_try_s = t
        dw, waited = r.decode, t - r.kv_first_try_s
        try:
            dw.engine.admit_kv(payload, preempt=waited > ADMIT_PREEMPT_AFTER_S)
        except KvCacheFullError as exc:
            if waited > KV_TIMEOUT_S:
                self._kv_failed(r, f"KV cache full for {KV_TIMEOUT_S:.0f}s: {exc}")
            else:
                self._push(t + ADMIT_RETRY_S, KV, (r, payload))
            return
        except ValueError as exc:
            self._kv_failed(r, str(exc))
            return
        dw.awaiting_kv -= 1
        r.rec.kv_transfer_s = t - r.prefill_end_s
        self._wake(dw, t)

    def _kv_failed(self, r: SimRequest, why: str) -> None:
        r.decode.awaiting_kv -= 1
        r.decode.handle.active_requests -= 1
        r.decode.engine.unpin(r.rec.request_id)
        r.rec.error = why

    def prefix_counters(self) -> list[WorkerPrefixCounters]:
        """Every worker's prefix-cache counters now (``pdserve bench``'s per-worker hit rates)."""
        stats = [(w, w.engine.stats()) for w in self.workers]
        return [
            WorkerPrefixCounters(w.role, w.handle.address, s["prefix_query_tokens"], s["prefix_hit_tokens"])
            for w, s in stats
        ]
