"""Prometheus metrics of the router, named in the style of vLLM's (``vllm:time_to_first_token_seconds``
becomes ``pdserve:time_to_first_token_seconds``).

Request metrics are observed by the router as each request's tokens arrive and when it ends;
per-worker gauges (:mod:`pdserve.router.worker_gauges`) are read from the pool's latest GetStats poll
at scrape time (every 0.1 s). Labels are bounded sets: ``finish_reason`` (stop, length, abort, error),
``reason`` (``REJECT_REASONS``), ``role`` (prefill, decode, colocated) and ``worker`` (``worker_labels``:
role and index, ``decode-0``). No request ids, and no worker addresses: the exposition names no internal
host or port, and a worker's series keep their labels when a restarted worker replaces it. Each
registry belongs to one router, so several routers can live in one process.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from pdserve.router.local_prefill import LOCAL_PREFILL_REASONS
from pdserve.router.worker_gauges import WorkerGauges
from pdserve.v1 import generate_pb2

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's buckets with finer steps below 10 ms, where CPU decode steps land
# fmt: off
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)
# fmt: on
BYTES_BUCKETS = tuple(float(x * 10**e) for e in range(3, 10) for x in (1, 2.5, 5))  # 1 kB .. 5 GB

# why a call was refused before its first token: a bad request (INVALID_ARGUMENT, ALREADY_EXISTS; HTTP 400,
# 404), no healthy worker (UNAVAILABLE), every worker at its bound (RESOURCE_EXHAUSTED; 429), no valid API
# key (UNAUTHENTICATED; 401, on any method or route that wants one)
REJECT_REASONS = ("invalid", "unavailable", "overloaded", "unauthenticated")
WAIT_STAGES = ("router", "prefill_queue", "kv_admission", "preempted")  # pdserve:request_wait_time_seconds
FINISH_LABELS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_ERROR: "error",
}


class RouterMetrics:
    """The router's registry. ``observe`` methods take monotonic nanoseconds; metrics are seconds."""

    def __init__(self, pool) -> None:
        disable_created_metrics()  # no *_created series (vLLM drops them too)
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Request received by the router to its first token there.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Gap between consecutive token messages of a request at the router.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Request received to its last message, for requests that ended.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "pdserve:request_queue_time_seconds",
            "Routing and prefill queue: received to the start of its prefill pass.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "pdserve:request_prefill_time_seconds",
            "Prefill forward pass and first-token sampling.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_time = Histogram(
            "pdserve:kv_transfer_time_seconds",
            "First token sampled to KV admitted by the decode worker (split placement only).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Histogram(
            "pdserve:kv_transfer_bytes",
            "KV cache bytes pushed from prefill to decode per request (split placement only).",
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.decode = Histogram(
            "pdserve:request_decode_time_seconds",
            "KV admitted (or first token, colocated) to the last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve:requests", "Requests that ended, by finish reason.", ["finish_reason"], registry=r
        )
        self.migrations = Counter(
            "pdserve:request_migrations",
            "Requests moved to live workers after theirs became unreachable (split).",
            registry=r,
        )
        self.rejections = Counter(
            "pdserve:requests_rejected",
            "Calls refused before their first token (invalid: bad request; "
            "unavailable: no healthy worker; overloaded: every worker at its bound; "
            "unauthenticated: missing or wrong API key).",
            ["reason"],
            registry=r,
        )
        self.prefilled_on_decode = Counter(
            "pdserve:requests_prefilled_on_decode",
            "Split placement: requests the decode worker prefilled itself (conditional disaggregation).",
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve:local_prefills",
            "Split or auto placement: requests routed to prefill on their decode worker, by reason "
            "(short: little of the prompt uncached there; prefill_busy: the prefill pool was behind "
            "and the decode worker had room; no_prefill_worker: auto placement without a prefill "
            "worker).",
            ["reason"],
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve:role_switches",
            "Auto placement: switchable workers that changed role, by the role left and the role taken.",
            ["from_role", "to_role"],
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "pdserve:prompt_tokens_cached", "Prompt tokens whose KV came from a worker's prefix cache.", registry=r
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of requests that completed.", registry=r)
        self.wait = Histogram(
            "pdserve:request_wait_time_seconds",
            "Time a completed request waited, by stage: router (routing, a live worker), "
            "prefill_queue (the worker's queue before its prefill), kv_admission (split: KV "
            "received to admitted, free KV blocks), preempted (to be recomputed after a "
            "preemption).",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "pdserve:request_preemptions",
            "Preemptions of completed requests (their KV freed to be recomputed).",
            registry=r,
        )
        self.stalls = Counter(
            "pdserve:stream_stalls",
            "Streams that went longer than the stall bound without a token (counted once "
            "per stall; the router logs each).",
            registry=r,
        )
        self.stalled = Gauge(
            "pdserve:streams_stalled", "Streams now longer than the stall bound without a token.", registry=r
        )
        for label in FINISH_LABELS.values():  # every series exists from the start, at 0
            self.requests.labels(label)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason)
        for stage in WAIT_STAGES:
            self.wait.labels(stage)
        for reason in LOCAL_PREFILL_REASONS:
            self.local_prefills.labels(reason)
        for a, b in (("prefill", "decode"), ("decode", "prefill")):
            self.role_switches.labels(a, b)
        r.register(WorkerGauges(pool))

    def token_arrival(self, gap_ns: int, first: bool) -> None:
        """A token message arrived ``gap_ns`` after the previous one (after receipt when ``first``)."""
        (self.ttft if first else self.itl).observe(gap_ns / 1e9)

    def local_prefilled(self, reason: str) -> None:
        """One request routed to prefill on its decode worker, for ``reason`` (LOCAL_PREFILL_REASONS)."""
        self.local_prefills.labels(reason).inc()

    def role_switched(self, from_role: str, to_role: str) -> None:
        """One switchable worker changed role."""
        self.role_switches.labels(from_role, to_role).inc()

    def rejected(self, reason: str) -> None:
        """One call refused for ``reason`` (one of REJECT_REASONS; ValueError otherwise, so the
        label set stays bounded)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {', '.join(REJECT_REASONS)}")
        self.rejections.labels(reason).inc()

    def finished(
        self, finish_reason: int, t0_ns: int, timings: generate_pb2.Timings | None, prompt_tokens: int = 0
    ) -> None:
        """A request received at ``t0_ns`` ended; ``timings`` (when it completed) gives its phases
        and ``prompt_tokens`` its prompt's length."""
        self.requests.labels(FINISH_LABELS.get(finish_reason, "error")).inc()
        self.e2e.observe((time.monotonic_ns() - t0_ns) / 1e9)
        if timings is None or finish_reason == generate_pb2.FINISH_REASON_ABORT:
            return
        self.queue.observe(timings.queue_ns / 1e9)
        waits = (
            timings.router_queue_ns,
            timings.queue_ns - timings.router_queue_ns,
            timings.kv_admission_ns,
            timings.preempted_ns,
        )
        for stage, ns in zip(WAIT_STAGES, waits):
            self.wait.labels(stage).observe(max(ns, 0) / 1e9)
        self.preemptions.inc(timings.num_preemptions)
        self.prefill.observe(timings.prefill_ns / 1e9)
        self.decode.observe(timings.decode_ns / 1e9)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(timings.cached_prompt_tokens)
        if timings.prefilled_on_decode:
            self.prefilled_on_decode.inc()
        if timings.kv_transfer_bytes:
            self.kv_time.observe(timings.kv_transfer_ns / 1e9)
            self.kv_bytes.observe(timings.kv_transfer_bytes)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
