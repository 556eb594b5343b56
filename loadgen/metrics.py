"""Per-request records and the serving metrics computed from them: the one definition of the
percentile, the SLO check, goodput and the run summary that ``pdserve bench``, ``pdserve compare``
and the benchmark scripts use.

* TTFT, TPOT, ITL, E2E latency: :class:`pdserve.router.timings.RequestTiming` (seconds; vLLM's
  ``benchmark_serving``), which :class:`RequestRecord` extends, as the router's client does.
* Percentile: linear interpolation between the two nearest values (numpy's default, and what
  vLLM's ``benchmark_serving`` reports); nan values are ignored.
* SLO check: a request meets the SLO when it finished normally, TTFT <= the TTFT SLO and TPOT <=
  the TPOT SLO; a request with a single output token has no TPOT and meets that SLO (as in vLLM).
* Goodput: requests meeting the SLO per second of the run, requests/s (DistServe, Zhong et al.,
  "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model
  Serving", OSDI 2024). SLO attainment is the fraction of all requests that meet it; failed
  requests count as misses.
* Prefix-reuse ceiling: the hit rate an infinite prefix cache would reach on a run's prompts
  (per-worker hit rates: :mod:`pdserve.loadgen.prefix_cache`).
* JSON: :func:`json_safe` writes nan and inf as null.

Summary keys end in their unit: ``_s`` seconds, ``_ms`` milliseconds (printed tables), ``_rps``
requests per second, ``_tokens_per_s`` tokens per second, ``_bytes``; counts and fractions have
none. Times are seconds relative to the start of the run (``time.perf_counter`` based).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from pdserve.router.timings import NAN, RequestTiming

OK_FINISH_REASONS = ("stop", "length")
BREAKDOWN_KEYS = ("queue", "prefill", "kv_transfer", "decode")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99", "min", "max")


@dataclass
class RequestRecord(RequestTiming):
    """One request of a benchmark run: :class:`RequestTiming`'s ``sent_s`` and ``token_times_s``
    (seconds relative to the run start, time.perf_counter based) and its metrics, plus what the
    server said about it."""

    index: int
    request_id: str
    scheduled_s: float  # when it was due to be sent
    prompt_tokens: int
    max_tokens: int
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
    def ok(self) -> bool:
        """No error and a normal finish ("stop" or "length")."""
        return not self.error and self.finish_reason in OK_FINISH_REASONS

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
        """True when ``r`` finished normally, TTFT <= the SLO and TPOT <= the SLO (both inclusive).

        A request with fewer than two output tokens has no TPOT and meets that SLO (as vLLM does).
        """
        if not r.ok or not r.ttft_s <= self.ttft_s:  # "not <=" also rejects nan
            return False
        return r.output_tokens < 2 or r.tpot_s <= self.tpot_s


def _clean(values: Iterable[float]) -> np.ndarray:
    a = np.asarray([float(v) for v in values if v is not None], dtype=float)
    return a[~np.isnan(a)]


def percentile(values: Iterable[float], p: float) -> float:
    """p-th percentile (0..100) of ``values``, in their unit, with linear interpolation (numpy's
    default, as vLLM's ``benchmark_serving``); nan and None are ignored; nan when nothing is left."""
    a = _clean(values)
    return float(np.percentile(a, p)) if a.size else NAN


def stats(values: Iterable[float]) -> dict:
    """``{"mean","p50","p90","p99","min","max","count"}`` over the non-nan values, in their unit (nan
    when there are none); the percentiles are :func:`percentile`'s."""
    a = _clean(values)
    if not a.size:
        return {**dict.fromkeys(STATS, NAN), "count": 0}
    out = {"mean": float(a.mean())}
    out.update({f"p{p}": percentile(a, p) for p in (50, 90, 99)})
    return {**out, "min": float(a.min()), "max": float(a.max()), "count": int(a.size)}


def _latency(name: str, values_s: Iterable[float]) -> dict:
    """``{name}_{stat}_s`` for each of :data:`STATS` and ``{name}_count``."""
    s = stats(values_s)
    return {**{f"{name}_{k}_s": s[k] for k in STATS}, f"{name}_count": s["count"]}


def _mean(values: Iterable[float]) -> float:
    a = _clean(values)
    return float(a.mean()) if a.size else NAN


def run_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the first ``sent_s`` to the last token arrival of any request; nan when undefined."""
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
    """Aggregate metrics of one run, in flat keys that end in their unit (module docstring).

    ``ttft_p90_s``, ``e2e_mean_s``, ... (TTFT, TPOT, pooled ITL, E2E: mean, p50, p90, p99, min, max,
    seconds; ``ttft_count``, ...: how many values) and the server-side breakdown (``queue_mean_s``,
    ``prefill_mean_s``, ``kv_transfer_mean_s``, ``decode_mean_s``) cover the ok requests only.
    ``request_throughput_rps``, ``output_tokens_per_s`` and ``total_tokens_per_s`` are per second of
    ``duration_s`` (default: :func:`run_duration`; a zero or undefined duration gives nan). With an
    ``slo``: ``slo_ttft_s``, ``slo_tpot_s``, ``slo_attainment`` (the fraction of *all* requests
    meeting it, :meth:`SLO.met`) and ``goodput_rps`` (their count per second; DistServe).
    """
    records = list(records)
    n = len(records)
    ok = [r for r in records if r.ok]
    duration = run_duration(records) if duration_s is None else float(duration_s)
    out: dict[str, Any] = {"requests": n, "completed": len(ok), "failed": n - len(ok), "duration_s": duration}
    out.update(_latency("ttft", (r.ttft_s for r in ok)))
    out.update(_latency("tpot", (r.tpot_s for r in ok)))
    out.update(_latency("itl", (g for r in ok for g in r.itl_s)))
    out.update(_latency("e2e", (r.e2e_s for r in ok)))
    out.update(
        request_throughput_rps=_rate(len(ok), duration, n),
        output_tokens_per_s=_rate(sum(r.output_tokens for r in ok), duration, n),
        total_tokens_per_s=_rate(sum(r.prompt_tokens + r.output_tokens for r in ok), duration, n),
        **{f"{k}_mean_s": _mean(getattr(r, f"{k}_s") for r in ok) for k in BREAKDOWN_KEYS},
        kv_transfer_bytes=sum(r.kv_transfer_bytes for r in ok),
        prefilled_on_decode=sum(r.prefilled_on_decode for r in ok),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok),
    )
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        out.update(slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
        out["slo_attainment"] = good / n if records else NAN
        out["goodput_rps"] = _rate(good, duration, n)
    return out


# summary keys as an earlier pdserve wrote them -> the keys :func:`summarize` writes
_RENAMED = {
    "request_throughput": "request_throughput_rps",
    "output_token_throughput": "output_tokens_per_s",
    "total_token_throughput": "total_tokens_per_s",
    "goodput": "goodput_rps",
    "rate": "rate_rps",
}


def read_summary(summary: dict) -> dict:
    """``summary`` in :func:`summarize`'s keys, also when it comes from a summary.json written with
    the nested keys (``{"ttft_s": {"p90": ...}}``, ``breakdown_s``, ``slo``) and the unitless
    throughput names of earlier releases. A summary in the current keys comes back unchanged (a copy)."""
    out = dict(summary)
    for name in LATENCY_METRICS:
        nested = out.get(f"{name}_s")
        if isinstance(nested, dict):
            del out[f"{name}_s"]
            for k, v in nested.items():
                out.setdefault(f"{name}_count" if k == "count" else f"{name}_{k}_s", v)
    for k, v in (out.pop("breakdown_s", None) or {}).items():
        out.setdefault(f"{k}_mean_s", v)
    if isinstance(out.get("slo"), dict):
        slo = out.pop("slo")
        out.setdefault("slo_ttft_s", slo.get("ttft_s"))
        out.setdefault("slo_tpot_s", slo.get("tpot_s"))
    for old, new in _RENAMED.items():
        if old in out:
            out.setdefault(new, out.pop(old))
    return out


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
