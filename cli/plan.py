"""``pdserve plan``: search placements of N workers with ``pdserve simulate``'s simulator and a
profile's step times; print the best candidates by predicted goodput and write plan.json and
plan.png (goodput per worker against P:D).

Torch-free at import (``pdserve --help`` builds every parser); the planner is imported when it runs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pdserve.cli.out_dir import drops_empty_out
from pdserve.cli.simulate import add_host_cores_arg, add_worker_size_args
from pdserve.loadgen.args import add_slo_args, add_workload_args
from pdserve.worker.flags import non_negative_int, positive_fraction, positive_int

TOP = 8


def int_list(text: str) -> tuple[int, ...]:
    import argparse

    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"need one or more non-negative integers: {text!r}")
    return vals


def positive_int_list(text: str) -> tuple[int, ...]:
    import argparse

    vals = int_list(text)
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"need one or more integers >= 1: {text!r}")
    return vals


def float_list(text: str) -> list[float]:
    import argparse

    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not vals or min(vals) <= 0 or not all(math.isfinite(v) for v in vals):
        raise argparse.ArgumentTypeError(f"need one or more positive rates: {text!r}")
    return vals


def add_plan_parser(sub) -> None:
    from pdserve.router.pool import ROUTING_POLICIES

    p = sub.add_parser(
        "plan",
        help="search placements (colocated, P:D ratios, local prefill, max-num-seqs) for the best goodput per worker",
        description="Find each candidate unit's highest rate meeting the SLO attainment target in simulation, "
        "rank by predicted goodput of N workers (floor(N / unit) units).",
    )
    p.add_argument("--profile", required=True, help="profile JSON written by pdserve profile")
    p.add_argument("--workers", type=int, required=True, help="workers in the cluster (N >= 1)")
    p.add_argument("--attainment", type=positive_fraction, default=0.9, help="SLO attainment target")
    p.add_argument("--max-unit", type=positive_int, default=4, help="largest split unit p + d searched (at most 8)")
    p.add_argument("--local-prefill-tokens", type=int_list, default=(0, 32, 256), help="split: values searched")
    p.add_argument("--max-num-seqs", type=positive_int_list, default=(16, 64), help="values searched")
    p.add_argument(
        "--rates",
        type=float_list,
        default=None,
        help="sweep these rates instead, req/s per unit, in ascending order whatever order they are given in",
    )
    p.add_argument("--max-probe-requests", type=positive_int, default=100, help="cap on the requests of one probe")
    p.add_argument("--search-steps", type=non_negative_int, default=4, help="bisections after bracketing the rate")
    add_worker_size_args(p)
    add_host_cores_arg(p)
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix-aware")
    p.add_argument("--out", default=f"plan_results/{time.strftime('%Y%m%d-%H%M%S')}", help="results folder")
    add_workload_args(p)
    add_slo_args(p, needed=True)
    p.set_defaults(func=cmd_plan)


@drops_empty_out
def cmd_plan(args) -> int:
    from pdserve.cli.out_dir import prepare_out_dir
    from pdserve.cli.simulate import range_notes, read_profile
    from pdserve.engine.config import EngineConfig
    from pdserve.loadgen.args import build_specs, fall_back_without_datasets, slo_from_args
    from pdserve.planner.plan import MAX_UNIT, SCALING_NOTE, Planner, candidates
    from pdserve.planner.simulate import SimConfig, Simulator

    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, not {args.workers}")
    if args.max_unit > MAX_UNIT:
        raise ValueError(f"--max-unit is at most {MAX_UNIT}, not {args.max_unit}")
    slo = slo_from_args(args)
    if slo is None:
        raise ValueError("plan needs an SLO: give --slo-ttft-ms and --slo-tpot-ms")
    if args.arrival != "trace" and args.max_probe_requests < args.num_requests:
        raise ValueError(
            f"--max-probe-requests {args.max_probe_requests} is below --num-requests {args.num_requests}: "
            "a probe sends at least --num-requests requests"
        )
    model, spec, dtype, serving, measured = read_profile(args.profile)
    if serving is None:
        print("the profile has no serving section: steps take the engine's time only", flush=True)
    engine = EngineConfig(
        model=spec,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
    )
    out = prepare_out_dir(args.out)
    note = fall_back_without_datasets(args)
    if note:
        print(note, flush=True)
    try:
        sim = Simulator(SimConfig(engine, "colocated", 1, 0), model, dtype)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the profile's model {spec!r}: {exc}") from None
    # a synthetic arrival process: as many distinct requests as the longest probe, so that no probe
    # sends a prompt twice (a repeat would meet the prefix cache, and no user sends one)
    wanted = args.num_requests
    if args.arrival != "trace":
        args.num_requests = max(wanted, args.max_probe_requests)
    specs = build_specs(args, sim.tokenizer, sim.max_model_len, 1.0)
    for note in range_notes(measured, specs):
        print(note, flush=True)
    if len(specs) < args.max_probe_requests:
        print(
            f"note: the trace gives {len(specs)} requests; probes longer than that replay them, "
            "and a replayed prompt meets the prefix cache",
            flush=True,
        )
    cands = candidates(args.workers, args.max_unit, args.local_prefill_tokens, args.max_num_seqs)
    planner = Planner(
        engine, model, dtype, slo, args.attainment, args.routing, args.max_requests_per_worker, args.search_steps,
        args.rates, args.max_probe_requests, serving, args.host_cores / args.workers, min_requests=wanted,
    )  # fmt: skip
    probe = f"{min(wanted, len(specs))}-{args.max_probe_requests}"
    print(f"searching {len(cands)} candidates with {probe} requests a probe; {SCALING_NOTE}", flush=True)
    t0 = time.perf_counter()
    rows = planner.run(cands, specs, args.workers)
    wall = time.perf_counter() - t0
    print_table(rows[:TOP])
    best = rows[0]
    roles = ", ".join(f"{v} {k}" for k, v in best["workers"].items())
    idle = args.workers - best["units"] * best["unit"]
    if best["goodput_per_worker_rps"] > 0:
        print(
            f"best: {best['label']} (unit {best['unit']}): {roles} of {args.workers} workers"
            f"{f' ({idle} idle)' if idle else ''}; predicted goodput {best['cluster_goodput_rps']:.3g} req/s "
            f"({best['goodput_per_worker_rps']:.3g} per worker)"
        )
    else:
        print(
            f"best: none: no placement meets the SLO for {args.attainment:.0%} of requests at any rate probed; "
            "loosen --slo-ttft-ms / --slo-tpot-ms or --attainment, or give a smaller workload"
        )
    for line in probe_warnings(best, args.max_probe_requests, rows):
        print(line, flush=True)
    doc = {
        "workers": args.workers,
        "profile": args.profile,
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
        "attainment_target": args.attainment,
        "requests_per_probe": [min(wanted, len(specs)), args.max_probe_requests],
        "simulations": planner.simulations,
        "scaling": SCALING_NOTE,
        "host_cores": args.host_cores,
        "serving_costs": serving is not None,
        "best": best,
        "candidates": rows,
    }
    (out / "plan.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    plot(rows, out / "plan.png")
    print(f"{planner.simulations} simulations in {wall:.1f} s; wrote {out / 'plan.json'}, {out / 'plan.png'}")
    return 0


def probe_warnings(best: dict, max_probe_requests: int, rows: list[dict] = ()) -> list[str]:
    """Warnings on how far to trust ``best``'s rate: it met the SLO at every rate the search
    probed (``search_ceiling``; with the other ``rows`` that did too, whose order is then no
    ranking), or its probes were cut at ``--max-probe-requests`` before a queue could build
    (``probe_capped``)."""
    if best.get("goodput_per_worker_rps", 0) <= 0:
        return []
    lines = []
    if best.get("search_ceiling"):
        tied = [r["label"] for r in rows if r is not best and r.get("search_ceiling")]
        names = ", ".join(tied[:3]) + (", ..." if len(tied) > 3 else "")
        others = f"{len(tied)} other{'s' if len(tied) != 1 else ''} ({names})"
        also = f"; so did {others}, so their order says nothing: raise the top of --rates to separate them"
        also = also if tied else ""
        lines.append(
            f"warning: {best['label']} met the SLO at every rate probed, up to {best['max_rate_rps']:.3g} req/s a "
            f"unit: its rate is the search's ceiling, not the placement's limit{also}"
        )
    if best.get("probe_capped"):
        lines.append(
            f"warning: at {best['max_rate_rps']:.3g} req/s a probe of {max_probe_requests} requests "
            "(--max-probe-requests) ends before a queue can build, so the predicted goodput may be too high "
            "and the ranking may change; raise --max-probe-requests (slower) to check it"
        )
    return lines


def print_table(rows: list[dict]) -> None:
    head = ["placement", "unit", "max rate", "goodput", "goodput/worker", "attainment", "TTFT p90 ms", "TPOT p50 ms"]
    cells = [
        [
            r["label"],
            str(r["unit"]),
            f"{r['max_rate_rps']:.3g}",
            f"{r['cluster_goodput_rps']:.3g}",
            f"{r['goodput_per_worker_rps']:.3g}",
            f"{r['slo_attainment']:.0%}",
            _ms(r["ttft_p90_ms"]),
            _ms(r["tpot_p50_ms"]),
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *cells)]
    print(
        "  ".join(h.ljust(w) for h, w in zip(head, widths)) + "   (req/s; max rate a unit, goodput of all the workers)"
    )
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def _ms(value: float) -> str:
    """A latency cell; "-" where no request met the rate (a NaN percentile)."""
    return "-" if math.isnan(value) else f"{value:.1f}"


def plot(rows: list[dict], path: Path) -> None:
    """Goodput per worker against P:D (the best of each ratio), colocated as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[tuple[int, int], float] = {}
    for r in rows:
        if r["placement"] == "split":
            key = (r["num_prefill"], r["num_decode"])
            best[key] = max(best.get(key, 0.0), r["goodput_per_worker_rps"])
    keys = sorted(best, key=lambda k: k[0] / (k[0] + k[1]))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(keys)), [best[k] for k in keys], "o-", label="split (best per ratio)")
    colo = [r["goodput_per_worker_rps"] for r in rows if r["placement"] == "colocated"]
    if colo:
        ax.axhline(max(colo), linestyle="--", color="gray", label="colocated")
    ax.set_xticks(range(len(keys)), [f"{p}:{d}" for p, d in keys])
    ax.set_xlabel("P:D")
    ax.set_ylabel("goodput per worker, req/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
