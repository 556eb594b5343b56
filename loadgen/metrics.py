"""Per-request records and the serving metrics computed from them.

Definitions follow the usual LLM serving benchmarks (vLLM's ``benchmark_serving``,
SGLang's ``bench_serving``):

* TTFT (time to first token): request sent -> first output token received by the client.
* TPOT (time per output token): ``(E2E - TTFT) / (output tokens - 1)``, i.e. the first token
  is excluded; undefined (nan) for requests with fewer than two output tokens.
* ITL (inter-token latency): gap between consecutive token arrivals; tokens delivered in one
  stream message share an arrival time and so give 0-second gaps.
* E2E latency: request sent -> last output token received.
* Goodput: requests per second that meet *both* the TTFT and the TPOT SLO, as defined by
  DistServe (Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized
  Large Language Model Serving", OSDI 2024). SLO attainment is the fraction of all requests that
  meet both; failed requests count as misses, and a request with a single output token meets the
  TPOT SLO (as in vLLM).
* Prefix-cache hit rate (per worker, over a run): prompt tokens whose KV came from the worker's
  prefix cache / prompt tokens the worker admitted, from its counters before and after the run.

All times are seconds relative to the start of the run (``time.perf_counter`` based).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

OK_FINISH_REASONS = ("stop", "length")
BREAKDOWN_KEYS = ("queue", "prefill", "kv_transfer", "decode")

NAN = float("nan")


@dataclass
class RequestRecord:
    """One request of a benchmark run. Times in seconds, relative to the run start (time.perf_counter based)."""

    index: int
    request_id: str
    scheduled_s: float  # when it was due to be sent
    sent_s: float  # when it was actually sent
    prompt_tokens: int
    max_tokens: int
    token_times_s: list[float] = field(default_factory=list)  # arrival time of each output token
    finish_reason: str = ""  # "stop" | "length" | "abort" | "error" | "" (cancelled before finishing)
    error: str = ""
    # server-side breakdown from the final stream message (seconds), 0 when unknown
    queue_s: float = 0.0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_s: float = 0.0
    kv_transfer_bytes: int = 0  # pushed from prefill to decode (pdserve split placement)
    prefilled_on_decode: bool = False  # pdserve split: the decode worker prefilled it (no KV moved)
    cached_prompt_tokens: int = 0  # prompt tokens served from a worker's prefix cache

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ok(self) -> bool:
        """No error and a normal finish ("stop" or "length")."""
        return not self.error and self.finish_reason in OK_FINISH_REASONS

    @property
    def ttft_s(self) -> float:
        """First token arrival - sent_s; nan if no tokens arrived."""
        return self.token_times_s[0] - self.sent_s if self.token_times_s else NAN

    @property
    def e2e_s(self) -> float:
        """Last token arrival - sent_s; nan if no tokens arrived."""
        return self.token_times_s[-1] - self.sent_s if self.token_times_s else NAN

    @property
    def tpot_s(self) -> float:
        """(E2E - TTFT) / (output_tokens - 1): the first token is excluded; nan below two tokens."""
        n = self.output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n >= 2 else NAN

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token arrivals (``output_tokens - 1`` entries)."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        """Every field plus the derived metrics, JSON-safe (nan -> None)."""
        d = asdict(self)
        d["token_times_s"] = list(self.token_times_s)
        d.update(
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            e2e_s=self.e2e_s,
            itl_s=self.itl_s,
            output_tokens=self.output_tokens,
            ok=self.ok,
        )
        return json_safe(d)

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        """Inverse of :meth:`to_json` (derived keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class SLO:
    """Latency service-level objectives, in seconds."""

    ttft_s: float
    tpot_s: float

    def met(self, r: RequestRecord) -> bool:
        """True when ``r`` finished normally, TTFT <= the SLO and TPOT <= the SLO.

        A request with fewer than two output tokens has no TPOT and meets that SLO (as vLLM does).
        """
        if not r.ok or not r.ttft_s <= self.ttft_s:  # "not <=" also rejects nan
            return False
        return r.output_tokens < 2 or r.tpot_s <= self.tpot_s


def _clean(values: Iterable[float]) -> np.ndarray:
    a = np.asarray([float(v) for v in values if v is not None], dtype=float)
    return a[~np.isnan(a)]


def percentile(values: Sequence[float], p: float) -> float:
    """p-th percentile (0..100) with linear interpolation (numpy's default); nan inputs are ignored, nan if empty."""
    a = _clean(values)
    return float(np.percentile(a, p)) if a.size else NAN


def stats(values: Iterable[float]) -> dict:
    """``{"mean","p50","p90","p99","min","max","count"}`` over the non-nan values (nan when there are none)."""
    a = _clean(values)
    if not a.size:
        return {"mean": NAN, "p50": NAN, "p90": NAN, "p99": NAN, "min": NAN, "max": NAN, "count": 0}
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {
        "mean": float(a.mean()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "min": float(a.min()),
        "max": float(a.max()),
        "count": int(a.size),
    }


def _mean(values: Iterable[float]) -> float:
    a = _clean(values)
    return float(a.mean()) if a.size else NAN


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first ``sent_s`` to the last token arrival of any request; nan when undefined."""
    starts = _clean(r.sent_s for r in records)
    ends = _clean(t for r in records for t in r.token_times_s)
    if not starts.size or not ends.size:
        return NAN
    return float(ends.max() - starts.min())


def _rate(count: float, duration_s: float, requests: int) -> float:
    """count / duration; 0 when a non-empty run had nothing to count, nan when the duration is unusable."""
    if count == 0 and requests:
        return 0.0
    if not math.isfinite(duration_s) or duration_s <= 0:
        return NAN
    return count / duration_s


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None, duration_s: float | None = None) -> dict:
    """Aggregate metrics of one run.

    Latency stats (TTFT, TPOT, pooled ITL, E2E) and the server-side breakdown cover the ok
    requests only; throughputs are per second of ``duration_s`` (default: :func:`run_duration`;
    a zero or undefined duration gives nan throughputs). With an ``slo``, ``slo_attainment`` is the
    fraction of *all* requests meeting both SLOs and ``goodput`` their count per second
    (DistServe, OSDI 2024). See the module docstring for the definitions.
    """
    records = list(records)
    n = len(records)
    ok = [r for r in records if r.ok]
    duration = run_duration(records) if duration_s is None else float(duration_s)
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "ttft_s": stats(r.ttft_s for r in ok),
        "tpot_s": stats(r.tpot_s for r in ok),
        "itl_s": stats(g for r in ok for g in r.itl_s),
        "e2e_s": stats(r.e2e_s for r in ok),
        "request_throughput": _rate(len(ok), duration, n),
        "output_token_throughput": _rate(sum(r.output_tokens for r in ok), duration, n),
        "total_token_throughput": _rate(sum(r.prompt_tokens + r.output_tokens for r in ok), duration, n),
        "breakdown_s": {k: _mean(getattr(r, f"{k}_s") for r in ok) for k in BREAKDOWN_KEYS},
        "kv_transfer_bytes": sum(r.kv_transfer_bytes for r in ok),
        "prefilled_on_decode": sum(r.prefilled_on_decode for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
    }
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        out["slo"] = {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
        out["slo_attainment"] = good / len(records) if records else NAN
        out["goodput"] = _rate(good, duration, n)
    return out


@dataclass(frozen=True)
class WorkerPrefixCounters:
    """One worker's prefix-cache counters (``WorkerStats``), in prompt tokens since it started."""

    role: str  # "prefill", "decode" or "colocated"
    address: str  # host:port
    query_tokens: int  # prompt tokens admitted (a recomputed request counts again)
    hit_tokens: int  # of those, tokens whose KV came from the prefix cache


def _hit_rate(hit: int, query: int) -> float:
    return hit / query if query else NAN


def prefix_cache_report(
    before: Sequence[WorkerPrefixCounters] | None, after: Sequence[WorkerPrefixCounters] | None
) -> dict | None:
    """Each worker's prefix-cache hit rate over a run, from snapshots ``before`` and ``after`` it.

    Workers are matched by address; one only in ``after`` (it replaced a worker during the run) or
    whose counters went down (it restarted) counts from zero. ``hit_rate`` is hit / query tokens,
    nan for a worker that admitted no prompt (a decode worker). Returns ``{"workers": [{"role",
    "address", "query_tokens", "hit_tokens", "hit_rate"}, ...], "query_tokens", "hit_tokens",
    "hit_rate"}`` (the last three over all workers), or None when a snapshot is missing (the server
    does not report the counters to this client).
    """
    if before is None or after is None:
        return None
    start = {w.address: w for w in before}
    workers = []
    for w in after:
        b = start.get(w.address)
        if b is not None and w.query_tokens >= b.query_tokens and w.hit_tokens >= b.hit_tokens:
            query, hit = w.query_tokens - b.query_tokens, w.hit_tokens - b.hit_tokens
        else:  # started or restarted during the run
            query, hit = w.query_tokens, w.hit_tokens
        workers.append(
            {
                "role": w.role,
                "address": w.address,
                "query_tokens": query,
                "hit_tokens": hit,
                "hit_rate": _hit_rate(hit, query),
            }
        )
    query, hit = sum(w["query_tokens"] for w in workers), sum(w["hit_tokens"] for w in workers)
    return {"workers": workers, "query_tokens": query, "hit_tokens": hit, "hit_rate": _hit_rate(hit, query)}


def prefix_reuse_ceiling(prompts: Sequence[Sequence[int]], block_size: int = 16) -> float:
    """The prefix-cache hit rate (hit / prompt tokens) of an infinite cache of ``block_size``-token
    blocks over ``prompts`` sent in order: each prompt hits its longest run of full blocks that an
    earlier prompt began with. The most any cache size or routing can reach on these requests;
    0.0 for no tokens. ValueError for ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    hit = total = 0
    for ids in prompts:
        keys, key = [], 0
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = hash((key, tuple(ids[start : start + block_size])))  # chained on the blocks before it
            keys.append(key)
        hit += block_size * next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        total += len(ids)
        seen.update(keys)
    return hit / total if total else 0.0


def format_prefix_cache(report: dict | None) -> str:
    """Lines for the printed summary: each worker's hit rate (``n/a`` where it admitted no prompt),
    then all workers', or one ``n/a`` line with the reason when there is no ``report``."""
    if report is None:
        return (
            "prefix cache hit rate: n/a (per-worker stats need pdserve's gRPC API and the cluster secret "
            "in $PDSERVE_CLUSTER_SECRET)"
        )

    def rate(d: dict) -> str:
        if not d["query_tokens"]:
            return "n/a"
        return f"{d['hit_rate'] * 100:.1f}% ({d['hit_tokens']:,} / {d['query_tokens']:,})"

    lines = [f"  {w['role']} {w['address']}: {rate(w)}" for w in report["workers"]]
    lines.append(f"  all workers: {rate(report)}")
    if report.get("ceiling") is not None:
        lines.append(
            f"  ceiling of these prompts (an infinite cache of 16-token blocks): {report['ceiling'] * 100:.1f}%"
        )
    return "\n".join(["prefix cache hit rate (cached / admitted prompt tokens):", *lines])


def json_safe(obj: Any) -> Any:
    """Copy of ``obj`` with nan/inf floats replaced by None (so ``json.dumps`` emits ``null``)."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
