"""Per-worker prefix-cache hit rates over a run, from each worker's counters before and after it:
prompt tokens whose KV came from the worker's prefix cache / prompt tokens the worker admitted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NAN = float("nan")


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
        bs = report.get("ceiling_block_size", 16)
        ceiling = report["ceiling"] * 100
        lines.append(f"  ceiling of these prompts (an infinite cache of {bs}-token blocks): {ceiling:.1f}%")
    return "\n".join(["prefix cache hit rate (cached / admitted prompt tokens):", *lines])
