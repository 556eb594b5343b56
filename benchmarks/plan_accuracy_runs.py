#!/usr/bin/env python3
"""The simulator against several measured runs of the same clusters: how far the prediction is
from the measurements' mean, beside how far the measurements spread.

    python benchmarks/plan_accuracy_runs.py OUT1 OUT2 OUT3 [--predicted OUT]

Each ``OUT`` is an ``--out`` folder of ``benchmarks/plan_accuracy.py`` (the same workloads, placements
and rates). For every run folder (``WORKLOAD/PLACEMENT/rate_R``) that all of them hold, it reads each
one's ``measured/summary.json`` and the ``predicted/summary.json`` of ``--predicted`` (default: the
last ``OUT``), and prints one Markdown table: per figure (goodput, TTFT p50 / p90, TPOT p50), the
measured range and mean, their coefficient of variation (standard deviation / mean), the predicted
figure and its error against the mean; then whether every figure is within 10 % of the mean. With
100 requests a run, a p90 is the 10th-slowest request, and two runs of one cluster differ by more
than the simulator may (docs/measurements.md). Run ``plan_accuracy.py --predict-only --out OUT``
first to predict with a new profile or simulator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from plan_accuracy_figures import TARGET, TARGET_FIGURES, rel_error

UNITS = {"goodput_rps": (1.0, "{:.2f}"), "ttft_p50_s": (1e3, "{:.0f}"), "ttft_p90_s": (1e3, "{:.0f}")}
UNITS["tpot_p50_s"] = (1e3, "{:.1f}")


def _rate(run: Path) -> float | None:
    try:
        return float(run.name.removeprefix("rate_"))
    except ValueError:
        return None


def run_folders(outs: list[Path]) -> list[Path]:
    """``WORKLOAD/PLACEMENT/rate_R`` folders (relative; R a number) with a measured summary in every
    one of ``outs``."""
    sets = [{p.parent.parent.relative_to(o) for p in o.glob("*/*/rate_*/measured/summary.json")} for o in outs]
    runs = [r for r in set.intersection(*sets) if _rate(r) is not None]
    return sorted(runs, key=lambda p: (p.parts[0], p.parts[1], _rate(p)))


def summary(path: Path) -> dict:
    """``path`` (a summary.json) with every target figure a number or None; ValueError naming the
    file when it is no JSON object or holds a figure of another kind."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a summary.json ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a summary.json (a JSON object)")
    for k in TARGET_FIGURES:
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{path}: {k} is {v!r}, not a number")
    return data


def figure(values: list[float], predicted: float | None) -> dict:
    """The measured values' range, mean and coefficient of variation; the prediction's error against the mean."""
    mean = statistics.mean(values)
    cv = statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0
    return {"min": min(values), "max": max(values), "mean": mean, "cv": cv, "predicted": predicted} | {
        "rel_error": rel_error(predicted, mean)
    }


def rows(outs: list[Path], predicted: Path) -> list[dict]:
    """One row per run folder: ``run`` and, per target figure, :func:`figure`."""
    out = []
    for run in run_folders(outs):
        measured = [summary(o / run / "measured" / "summary.json") for o in outs]
        pred_file = predicted / run / "predicted" / "summary.json"
        pred = summary(pred_file) if pred_file.exists() else {}
        for k in TARGET_FIGURES:
            if any(m.get(k) is None for m in measured):
                raise ValueError(f"{run}: a measured summary.json has no {k}")
        figs = {k: figure([m[k] for m in measured], pred.get(k)) for k in TARGET_FIGURES}
        out.append({"run": str(run), "figures": figs})
    return out


def table(rows_: list[dict], runs: int) -> str:
    head = ["run", *(f"{k} (measured range, mean, cv; predicted, error)" for k in TARGET_FIGURES), "within_10pct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows_:
        cells = [r["run"]]
        for k in TARGET_FIGURES:
            f, (scale, fmt) = r["figures"][k], UNITS[k]
            v = {n: fmt.format(f[n] * scale) for n in ("min", "max", "mean")}
            p = "-" if f["predicted"] is None else fmt.format(f["predicted"] * scale)
            err = "n/a" if f["predicted"] is None else f"{f['rel_error'] * 100:+.0f}%"
            cells.append(f"{v['min']}-{v['max']}, {v['mean']}, {f['cv'] * 100:.0f}%; {p} ({err})")
        ok = all(f["predicted"] is not None and abs(f["rel_error"]) <= TARGET for f in r["figures"].values())
        cells.append("yes" if ok else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    met = sum(line.endswith("| yes |") for line in lines[2:])
    return "\n".join(lines) + f"\n\n{met} of {len(rows_)} rows within 10 % of the mean of {runs} measured runs."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path, help="plan_accuracy.py --out folders")
    p.add_argument("--predicted", type=Path, default=None, help="whose predictions to hold (default: the last folder)")
    args = p.parse_args()
    for o in [*args.outs, *([args.predicted] if args.predicted else [])]:
        if not o.is_dir():
            p.error(f"{o}: no such folder")
    if len({o.resolve() for o in args.outs}) < len(args.outs):
        p.error("a folder is given twice: each run counts once")
    try:
        found = rows(args.outs, args.predicted or args.outs[-1])
    except ValueError as exc:
        p.error(str(exc))
    if not found:
        p.error("no run folder (WORKLOAD/PLACEMENT/rate_R/measured/summary.json) is in every folder given")
    print(table(found, len(args.outs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
