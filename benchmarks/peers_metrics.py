"""W2 figures of ``benchmarks/peers.py``, from the per-request records both clients save.

Each client's raw output becomes :class:`pdserve.loadgen.metrics.RequestRecord`s, and every figure
comes from pdserve's one set of definitions: TTFT, TPOT, ITL and E2E latency from
:class:`pdserve.router.timings.RequestTiming` (seconds; TPOT = (E2E - TTFT) / (output tokens - 1),
as vLLM's ``benchmark_serving``), percentiles, the SLO check and goodput (requests meeting both SLOs
per second, DistServe) from :func:`pdserve.loadgen.metrics.summarize`. Keys end in their unit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdserve.loadgen.metrics import SLO, RequestRecord, read_summary, summarize

KEEP_UP = 0.9  # a rate is sustained when requests complete at >= this fraction of the rate they arrive


def vllm_records(result: dict) -> tuple[list[RequestRecord], float, dict]:
    """Records from a ``vllm bench serve --save-detailed`` result, the client's own duration (s) and
    its own figures.

    Times are relative to the first send. vLLM saves each request's TTFT and the gaps between the
    later stream chunks (ITLs), and its latency is the last chunk's arrival: the token arrival times
    are rebuilt as TTFT, then TTFT plus each running sum of the ITLs. A request whose token count
    (``output_lens``) exceeds its chunks gets the extra tokens at the last chunk's arrival, as
    pdserve's own OpenAI client records them.
    """
    starts = result.get("start_times") or [0.0] * len(result["ttfts"])
    t0 = min(starts, default=0.0)
    records = []
    for i, ttft in enumerate(result["ttfts"]):
        n, error, sent = result["output_lens"][i], result["errors"][i], starts[i] - t0
        times: list[float] = []
        if not error and n > 0:
            times = [sent + ttft]
            for gap in result["itls"][i] or []:
                times.append(times[-1] + gap)
            times = times[:n] + times[-1:] * (n - len(times))
        records.append(
            RequestRecord(
                index=i,
                request_id=f"vllm-{i}",
                scheduled_s=sent,
                sent_s=sent,
                prompt_tokens=result["input_lens"][i],
                max_tokens=n,
                token_times_s=times,
                finish_reason="length" if times else "error",
                error="" if times else (error or "no output token"),
            )
        )
    reported = {
        k: result.get(k)
        for k in ("duration", "request_throughput", "request_goodput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
    }
    return records, result["duration"], reported


def pdserve_records(results_jsonl: Path, summary: dict) -> tuple[list[RequestRecord], float, dict]:
    """Records from ``pdserve bench``'s results.jsonl, the client's own duration (s) and its own
    figures (from its summary.json, in any release's keys)."""
    records = [RequestRecord.from_json(json.loads(line)) for line in results_jsonl.read_text().splitlines()]
    summary = read_summary(summary)
    reported = {k: summary.get(k) for k in ("duration_s", "request_throughput_rps", "goodput_rps")}
    return records, summary["duration_s"], reported


def _per_s(count: int, span_s: float) -> float:
    return count / span_s if span_s > 0 else math.nan


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def w2_metrics(records: list[RequestRecord], client_duration_s: float, slo: SLO) -> dict:
    """One run's figures: :func:`~pdserve.loadgen.metrics.summarize`'s (duration: first send to last
    token, for every client alike; ``request_throughput_rps``: completed requests per second of it;
    ``goodput_rps``, ``slo_attainment``; ``ttft_p90_s``, ...) plus ``client_duration_s`` (the
    client's own figure, kept for reference), ``offered_rps`` ((requests - 1) / first to last send),
    ``completion_rps`` ((completed - 1) / first to last finish), ``sustained`` (every request
    completed, at >= KEEP_UP x the offered rate) and ``input_tokens_mean`` / ``output_tokens_mean``
    (completed requests)."""
    out = summarize(records, slo)
    ok = [r for r in records if r.ok]
    sends = sorted(r.sent_s for r in records)
    finishes = sorted(r.token_times_s[-1] for r in ok)
    offered = _per_s(len(sends) - 1, sends[-1] - sends[0]) if len(sends) > 1 else math.nan
    completing = _per_s(len(finishes) - 1, finishes[-1] - finishes[0]) if len(finishes) > 1 else math.nan
    out.update(
        client_duration_s=client_duration_s,
        offered_rps=offered,
        completion_rps=completing,
        sustained=bool(records) and len(ok) == len(records) and completing >= KEEP_UP * offered,
        input_tokens_mean=_mean([r.prompt_tokens for r in ok]),
        output_tokens_mean=_mean([r.output_tokens for r in ok]),
    )
    return out


def pooled_metrics(runs: list[tuple[list[RequestRecord], dict]], slo: SLO) -> dict:
    """One rate's figures over several rounds, each ``(records, its w2_metrics)``: the latency
    percentiles and SLO attainment of all their requests together, goodput and throughput per second
    of the rounds' summed durations, ``offered_rps`` / ``completion_rps`` the rounds' mean,
    ``sustained`` only when every round was, and ``goodput_by_round_rps`` each round's own goodput.
    The latest round's extra keys (CPU per token, busy cores, the client's figures) are kept."""
    each = [m for _, m in runs]
    records = [r for rs, _ in runs for r in rs]
    out = {**each[-1], **summarize(records, slo, duration_s=sum(m["duration_s"] for m in each))}
    ok = [r for r in records if r.ok]
    out.update(
        client_duration_s=sum(m["client_duration_s"] for m in each),
        offered_rps=_mean([m["offered_rps"] for m in each]),
        completion_rps=_mean([m["completion_rps"] for m in each]),
        sustained=all(m["sustained"] for m in each),
        input_tokens_mean=_mean([r.prompt_tokens for r in ok]),
        output_tokens_mean=_mean([r.output_tokens for r in ok]),
        goodput_by_round_rps=[m["goodput_rps"] for m in each],
    )
    return out


def saturation(per_rate: dict) -> tuple[float, str] | None:
    """(rate, qualifier): the highest swept rate sustained below the first one that is not.
    "=" found, ">=" every rate sustained, "<" not even the lowest; None without figures."""
    rates = sorted((float(r), m) for r, m in per_rate.items() if "error" not in m)
    if not rates:
        return None
    last = None
    for rate, m in rates:
        if not m["sustained"]:
            return (last, "=") if last is not None else (rate, "<")
        last = rate
    return last, ">="


def w2_summary(results: dict) -> dict:
    """Per system: ``saturation_rps`` ((rate, qualifier), :func:`saturation`),
    ``max_request_throughput_rps`` over the sweep, ``best_goodput_rps`` and the rate it was reached
    at, ``best_goodput_at_rps``."""
    out = {}
    for system, per in results.items():
        figures = {r: m for r, m in per["rates"].items() if "error" not in m}
        if not figures:
            out[system] = {"error": per.get("error", "no rate finished")}
            continue
        best_rate = max(figures, key=lambda r: (figures[r]["goodput_rps"], -float(r)))
        out[system] = {
            "saturation_rps": saturation(per["rates"]),
            "max_request_throughput_rps": max(m["request_throughput_rps"] for m in figures.values()),
            "best_goodput_rps": figures[best_rate]["goodput_rps"],
            "best_goodput_at_rps": float(best_rate),
        }
    return out
