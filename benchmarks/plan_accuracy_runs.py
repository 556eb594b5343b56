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


def run_folders(outs: list[Path]) -> list[Path]:
    """``WORKLOAD/PLACEMENT/rate_R`` folders (relative) with a measured summary in every one of ``outs``."""
    sets = [{p.parent.parent.relative_to(o) for p in o.glob("*/*/rate_*/measured/summary.json")} for o in outs]
    return sorted(set.intersection(*sets), key=lambda p: (p.parts[0], p.parts[1], float(p.parts[2][5:])))


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
        measured = [json.loads((o / run / "measured" / "summary.json").read_text()) for o in outs]
        pred_file = predicted / run / "predicted" / "summary.json"
        pred = json.loads(pred_file.read_text()) if pred_file.exists() else {}
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
    for o in args.outs:
        if not o.is_dir():
            p.error(f"{o}: no such folder")
    found = rows(args.outs, args.predicted or args.outs[-1])
    if not found:
        p.error("no run folder (WORKLOAD/PLACEMENT/rate_R/measured/summary.json) is in every folder given")
    print(table(found, len(args.outs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
