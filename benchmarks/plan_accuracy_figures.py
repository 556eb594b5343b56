"""Figures of ``benchmarks/plan_accuracy.py``: the placements it takes, the relative error of each
predicted figure against the measured one, which rows are at or above saturation, and the Markdown
table. Standard library only, so the tests load it without running anything."""

from __future__ import annotations

import math
from dataclasses import dataclass

TARGET = 0.10  # |predicted - measured| / measured, below saturation
# (summary.json key, column): the first four are the target's figures; ITL p50 is shown beside them
FIGURES = (
    ("goodput_rps", "goodput_rps"),
    ("ttft_p50_s", "ttft_p50_ms"),
    ("ttft_p90_s", "ttft_p90_ms"),
    ("tpot_p50_s", "tpot_p50_ms"),
    ("itl_p50_s", "itl_p50_ms"),
)
TARGET_FIGURES = tuple(key for key, _ in FIGURES[:4])
SATURATION_RULES = ("load", "slo")


@dataclass(frozen=True)
class Placement:
    """One ``--placements`` entry: ``KIND:P+D`` (P prefill + D decode workers) or ``KIND:N`` (N workers
    in all, passed as ``--prefill N-1 --decode 1``: a colocated cluster runs prefill + decode workers)."""

    text: str
    kind: str
    prefill: int
    decode: int

    def flags(self) -> list[str]:
        """The flags ``pdserve serve`` and ``pdserve simulate`` take for it."""
        return ["--placement", self.kind, "--prefill", str(self.prefill), "--decode", str(self.decode)]


def parse_placements(text: str) -> list[Placement]:
    """``colocated:2,split:1+1,auto:2`` as placements, in order; ValueError (one line) for a bad entry.
    The kind is not checked here: ``pdserve serve`` says which kinds it knows."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        kind, sep, count = entry.partition(":")
        try:
            if not sep or not kind:
                raise ValueError
            if "+" in count:
                prefill, decode = (int(x) for x in count.split("+"))
            else:
                prefill, decode = int(count) - 1, 1
        except ValueError:
            raise ValueError(
                f"placement {entry!r}: expected KIND:N or KIND:P+D, e.g. colocated:2 or split:1+1"
            ) from None
        if prefill < 1 or decode < 1:
            raise ValueError(f"placement {entry!r}: needs at least 2 workers (1 prefill + 1 decode)")
        out.append(Placement(entry, kind, prefill, decode))
    if not out:
        raise ValueError("no placement given")
    return out


def rel_error(predicted: float | None, measured: float | None) -> float:
    """(predicted - measured) / measured, signed; 0.0 when both are 0, inf when only the measured is 0,
    nan when either is missing or nan."""
    if predicted is None or measured is None or math.isnan(predicted) or math.isnan(measured):
        return math.nan
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / abs(measured)


def compare(predicted: dict, measured: dict) -> dict:
    """Per figure of :data:`FIGURES`: ``{key: {"predicted", "measured", "rel_error"}}``."""
    return {
        key: {"predicted": predicted.get(key), "measured": measured.get(key)}
        | {"rel_error": rel_error(predicted.get(key), measured.get(key))}
        for key, _ in FIGURES
    }


def saturated(measured: dict, rule: str = "load") -> bool:
    """Whether one measured run is at or above saturation. ``load``: it was not sustained (a request
    failed, or requests finished at < 0.9 x the offered rate: ``sustained`` of peers_metrics.w2_metrics).
    ``slo``: that, or its TTFT p90 over the TTFT SLO (so goodput falls well below the rate)."""
    if rule not in SATURATION_RULES:
        raise ValueError(f"saturation rule must be one of {SATURATION_RULES}, got {rule!r}")
    if not measured.get("sustained", False):
        return True
    if rule == "slo":
        ttft, slo = measured.get("ttft_p90_s"), measured.get("slo_ttft_s")
        return ttft is None or slo is None or math.isnan(ttft) or ttft > slo
    return False


def mark_saturation(rows: list[dict], rule: str = "load") -> None:
    """Set each row's ``saturated``: its own run (:func:`saturated`), or a lower rate of the same
    workload and placement was. Rows without a measured run (``error``) are left unmarked."""
    first: dict[tuple, float] = {}  # (workload, placement) -> lowest saturated rate
    for r in rows:
        if "error" not in r and saturated(r["measured"], rule):
            key = (r["workload"], r["placement"])
            first[key] = min(first.get(key, math.inf), r["rate_rps"])
    for r in rows:
        if "error" not in r:
            r["saturated"] = r["rate_rps"] >= first.get((r["workload"], r["placement"]), math.inf)


def within_target(row: dict, target: float = TARGET) -> bool | None:
    """True when every target figure's |relative error| <= ``target``; None for a saturated or failed row."""
    if "error" in row or row.get("saturated", True):
        return None
    return all(abs(row["figures"][k]["rel_error"]) <= target for k in TARGET_FIGURES)


def _value(key: str, v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.2f}" if key.endswith("_rps") else f"{v * 1e3:.0f}"


def _cell(key: str, fig: dict) -> str:
    err = fig["rel_error"]
    pct = "n/a" if math.isnan(err) else ("inf" if math.isinf(err) else f"{err * 100:+.0f}%")
    return f"{_value(key, fig['predicted'])} / {_value(key, fig['measured'])} ({pct})"


def markdown_table(rows: list[dict]) -> str:
    """One row per run: each figure as ``predicted / measured (relative error)``, then whether it is
    saturated and whether its target figures are within :data:`TARGET`."""
    head = ["workload", "placement", "rate_rps", *(col for _, col in FIGURES), "saturated", "within_10pct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], r["placement"], f"{r['rate_rps']:g}"]
        if "error" in r:
            cells += ["-"] * len(FIGURES) + ["-", "failed: " + r["error"].replace("|", "/")]
        else:
            ok = within_target(r)
            cells += [_cell(key, r["figures"][key]) for key, _ in FIGURES]
            cells += ["**yes**" if r["saturated"] else "no", "-" if ok is None else ("yes" if ok else "**no**")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict], target: float = TARGET) -> str:
    """One line: how many rows below saturation meet the target, and the figures that miss it."""
    below = [r for r in rows if within_target(r, target) is not None]
    if not below:
        return "No row below saturation: the target (within 10 % below saturation) is not read by this run."
    misses = [
        f"{r['workload']} {r['placement']} @ {r['rate_rps']:g}: {k} {r['figures'][k]['rel_error'] * 100:+.0f}%"
        for r in below
        for k in TARGET_FIGURES
        if not abs(r["figures"][k]["rel_error"]) <= target
    ]
    good = sum(1 for r in below if within_target(r, target))
    text = f"Below saturation, {good} of {len(below)} rows have goodput, TTFT p50/p90 and TPOT p50 within "
    text += f"{target * 100:.0f} % of measured."
    return text + (" Outside it: " + "; ".join(misses) + "." if misses else "")


def report(header: list[str], rows: list[dict]) -> str:
    busy = [
        f"{r['workload']} {r['placement']} @ {r['rate_rps']:g}" for r in rows if r.get("busy_cores_before", 0) >= 0.5
    ]
    text = "\n".join(["# pdserve simulate against pdserve bench", "", *header, "", markdown_table(rows), ""])
    text += "\n" + verdict(rows) + "\n"
    if busy:
        text += f"\nOther processes kept >= 0.5 cores busy just before: {', '.join(busy)}. "
        text += "Rerun those on a quiet machine.\n"
    return text
