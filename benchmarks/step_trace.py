"""Serving workers' own engine steps against a profile's step model: where a simulation's time goes
wrong.

Run a cluster with ``PDSERVE_STEP_TRACE=FOLDER`` in its environment (every worker then writes each
engine step to ``FOLDER/steps-<pid>.jsonl``, ``worker/step_trace.py``), load it, and give this
script the folder and the profile the simulator uses:

    PDSERVE_STEP_TRACE=/tmp/steps pdserve serve --model embedded:llama-80m --dtype bfloat16 ...
    python benchmarks/step_trace.py /tmp/steps --profile profile.json

For each worker process and kind of step (``prefill``: prompt chunks only; ``mixed``: chunks beside
decode rows; ``decode``: decode rows only) it prints the steps, the median measured and predicted
times (ms), measured / predicted (the median step's, its 10th and 90th percentiles, and the sum's,
which weighs long steps more), and the engine thread's CPU time over the step's wall time (below 1
when the thread waited for its core or for the GIL while the step ran).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pdserve.planner.step_model import StepModel
from pdserve.worker.step_trace import read_steps, step_shape

KINDS = ("prefill", "mixed", "decode")


def kind(step: dict) -> str:
    if step["chunks"]:
        return "mixed" if step["b"] else "prefill"
    return "decode"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rows(steps: list[dict], model: StepModel) -> list[dict]:
    """One summary per kind of step present in ``steps``."""
    out = []
    for k in KINDS:
        mine = [s for s in steps if kind(s) == k]
        if not mine:
            continue
        wall = [(s["t1"] - s["t0"]) / 1e9 for s in mine]
        predicted = [model.batch_s(*step_shape(s)) for s in mine]
        ratio = [w / p for w, p in zip(wall, predicted)]
        cpu = [s["cpu_ns"] / (s["t1"] - s["t0"]) for s in mine if s["t1"] > s["t0"]]
        out.append(
            dict(
                kind=k,
                steps=len(mine),
                measured_ms=statistics.median(wall) * 1e3,
                predicted_ms=statistics.median(predicted) * 1e3,
                ratio_p50=statistics.median(ratio),
                ratio_p10=pct(ratio, 0.1),
                ratio_p90=pct(ratio, 0.9),
                ratio_sum=sum(wall) / sum(predicted),
                cpu_share=statistics.median(cpu) if cpu else float("nan"),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the PDSERVE_STEP_TRACE folder")
    p.add_argument("--profile", required=True, help="the pdserve profile JSON whose step model to compare with")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        model = StepModel.from_profile(json.loads(Path(args.profile).read_text()))
    except (OSError, ValueError) as exc:
        p.error(f"--profile: {exc}")
    if not Path(args.folder).is_dir():
        p.error(f"{args.folder}: no such folder")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: no such folder")
    files = sorted(Path(args.folder).glob("steps-*.jsonl"))
    if not files:
        p.error(f"no steps-*.jsonl in {args.folder} (was PDSERVE_STEP_TRACE set for the workers?)")
    head = f"{'file':<24}{'kind':<9}{'steps':>7}{'meas ms':>9}{'pred ms':>9}"
    print(head + "".join(f"{h:>7}" for h in ("p50", "p10", "p90", "sum")) + f"{'cpu':>6}")
    table = []
    for f in files:
        steps, bad = read_steps(f)
        if bad or not steps:
            print(f"{f.name}: {len(steps)} steps; {bad} lines skipped (not steps: cut short or damaged)")
        for r in rows(steps, model):
            table.append({"file": f.name, **r})
            print(
                f"{f.name:<24}{r['kind']:<9}{r['steps']:>7}{r['measured_ms']:>9.2f}{r['predicted_ms']:>9.2f}"
                f"{r['ratio_p50']:>7.2f}{r['ratio_p10']:>7.2f}{r['ratio_p90']:>7.2f}{r['ratio_sum']:>7.2f}"
                f"{r['cpu_share']:>6.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
