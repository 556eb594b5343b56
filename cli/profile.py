"""``pdserve profile``: measure one engine on this machine and write the profile JSON (raw points,
the fitted step-time model and the machine's description) that a planner reads.

This module stays torch-free at import (``pdserve --help`` builds every parser); the measurement
(``pdserve.planner.profile``) is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from pdserve.planner.grid import DEFAULT, QUICK, USER_FIELDS
from pdserve.worker.flags import add_engine_args, engine_config_from_args, non_negative_float, positive_int

DEFAULT_BUDGET_S = 600.0


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1, kept in increasing order without repeats."""
    try:
        values = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return tuple(values)


def add_profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure prefill, decode, mixed steps and the KV hand-off on this machine; write a fitted step-time model",
        description="Measure the engine on this machine (prefill, decode and mixed step times, the KV hand-off over "
        "loopback gRPC) and write the points, a fitted step-time model and the machine's description as JSON.",
    )
    add_engine_args(p)  # on CPU --threads defaults to 1 here, the threads of a worker of `pdserve serve`
    p.add_argument("--out", default="profile.json", help="the profile JSON to write (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a few small points of each kind (seconds, for tests)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed runs per point (default 5, 3 quick)")
    p.add_argument(
        "--time-budget",
        type=non_negative_float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help=f"about how long the whole profile may take (default {DEFAULT_BUDGET_S:g}): after a few calibration "
        "steps, the largest values of the built-in grid are dropped, the costliest first, until the estimate "
        "fits; values given with the flags below are kept. 0: no cut (the whole built-in grid)",
    )
    p.add_argument(
        "--no-serving",
        dest="serving",
        action="store_false",
        help="skip the serving section (a real worker, router and client on loopback: the time a step and a "
        "token take beyond the engine's); simulate then charges the engine's steps only",
    )
    grid = (
        ("--prefill-tokens", "uncached prompt tokens of the prefill steps"),
        ("--cached-tokens", "cached prefix lengths, tokens (whole KV blocks)"),
        ("--batch-sizes", "sequences of the decode steps"),
        ("--context-lens", "tokens of context per decoding sequence"),
    )
    for flag, what in grid:
        p.add_argument(flag, type=int_list, default=None, help=f"comma-separated {what} (default: the built-in grid)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from pdserve.planner.profile import run_profile

    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        raise ValueError(f"--out {args.out}: is a folder; name the JSON file to write")
    if not os.path.isdir(os.path.dirname(out)):
        raise ValueError(f"--out {args.out}: no such folder")
    existed = os.path.exists(out)
    try:  # before minutes of profiling, not after
        with open(out, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {args.out}: cannot write it here: {exc.strerror}") from None
    if not existed:
        os.remove(out)
    grid = QUICK if args.quick else DEFAULT
    chosen = {f: getattr(args, f) for f in USER_FIELDS if getattr(args, f) is not None}
    grid = replace(grid, **chosen, repeats=args.repeats or grid.repeats)
    print(
        f"profiling {args.model or 'embedded'}: {'quick' if args.quick else 'default'} grid, "
        f"median of {grid.repeats} runs a point, spread over {len(grid.pass_repeats())} passes over the points",
        flush=True,
    )
    cfg = engine_config_from_args(args)
    if cfg.device == "cpu" and cfg.torch_threads is None:  # a worker's threads: serve's --cpus-per-worker 1
        cfg = replace(cfg, torch_threads=1)
    say = lambda line: print(line, flush=True)  # noqa: E731
    serving = None
    if args.serving:
        from pdserve.planner.budget import ServingPlan
        from pdserve.planner.serving import add_serving, serving_plan

        serving = lambda model, room: serving_plan(cfg, args.quick, room, model)  # noqa: E731
    profile = run_profile(cfg, grid, set(chosen), say, args.time_budget or None, serving)
    if args.serving:
        add_serving(profile, cfg, ServingPlan.from_dict(profile["settings"]["serving_plan"]), say)
    print(format_fits(profile))
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {args.out} in {profile['elapsed_s']:.1f} s (estimated {profile['settings']['estimated_s']:.1f} s)")
    return 0


SCALES = {
    "s": (1e3, "ms"),
    "s/token": (1e6, "us/token"),
    "s/token^2": (1e9, "ns/token^2"),
    "s/sequence": (1e6, "us/seq"),
    "s/request": (1e3, "ms/request"),
    "s/step": (1e6, "us/step"),
    "s/context token": (1e9, "ns/ctx token"),
    "bytes/s": (1e-9, "GB/s"),
    "ratio": (1.0, "x"),
}


def format_fits(profile: dict) -> str:
    """The machine and each fit's coefficients and error, one line each."""
    m = profile["machine"]
    threads = f"{m['torch_threads']} torch thread{'s' if m['torch_threads'] != 1 else ''}"
    lines = [f"{m['cpu_model']}, {threads}, {m['device']}, {m['dtype']}, model {m['model']}"]
    for section, fit in profile["fits"].items():
        coefs = []
        for name, c in fit["coefficients"].items():
            scale, unit = SCALES[c["unit"]]
            coefs.append(f"{name} {'inf' if c['value'] is None else format(c['value'] * scale, '.4g')} {unit}")
        err = fit["error"]
        tail = f"max {err['max_rel']:.0%} median {err['median_rel']:.0%} of {err['points']} points" if err else "-"
        lines.append(f"{section:<8} {', '.join(coefs):<64} error {tail}")
    return "\n".join(lines)
