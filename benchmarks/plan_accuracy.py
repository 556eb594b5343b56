#!/usr/bin/env python3
"""How close ``pdserve simulate`` comes to the real system: predicted against measured, per workload,
placement and rate, on this machine.

    python benchmarks/plan_accuracy.py                                  # everything, defaults (about 2 h on 2 cores)
    python benchmarks/plan_accuracy.py --profile profile.json --workloads w2 --rates 2 --num-requests 20 \\
        --placements colocated:2,split:1+1                              # a quick run

For each workload, placement (``--placements``: ``colocated:2`` 2 colocated workers, ``split:1+1`` one
prefill + one decode worker, ``auto:2``; ``KIND:N`` or ``KIND:P+D``) and rate it runs the same flags
twice: ``pdserve simulate --profile P`` (the prediction), and ``pdserve bench`` against a fresh
``pdserve serve`` on a local Ray instance, 1 CPU per worker, loopback only (the measurement: a new
cluster for every run, so no run meets another's caches; a few warm-up requests first). Without
``--profile`` it first runs ``pdserve profile`` on the model and dtype (``--model``, ``--dtype``) and
keeps it in ``--out``; with one, the model and dtype are the profile's.

Workloads (``--workloads``): ``w2``, 256 in / 64 out tokens (``--input-len``, ``--output-len``), Poisson
arrivals at each of ``--rates``, prefix caching off; ``azure-conv``, the Azure conversation trace
(lengths x 0.25) and ``mooncake-conversation``, the Mooncake one (a 1/16 sample of its conversations,
lengths x 1/32, outputs of ``--output-len``), both rescaled to each of ``--trace-rates``, prompts capped
at ``--max-input-tokens``; ``phases``, a load that changes over time (``phased_trace.py``: decode-heavy
and prompt-heavy phases in turn), at each of ``--trace-rates``, prefix caching off. Traces are
skipped, saying so, when the datasets folder lacks them. Every run sends ``--num-requests`` random-token
prompts and is scored at ``--slo-ttft-ms`` / ``--slo-tpot-ms``.

It prints the CPU (``lscpu`` model name) and core count, then one Markdown table: per run, goodput
(req/s meeting both SLOs), TTFT p50 / p90, TPOT p50 and ITL p50 as ``predicted / measured (relative
error)``, whether the run is at or above saturation (``--saturation load``: a request failed or
requests finished at < 0.9 x the offered rate, at this rate or a lower one; ``slo``: that, or TTFT
p90 over the SLO) and whether its goodput, TTFT p50/p90 and TPOT p50 are within 10 % of measured
(read only below saturation), then one line over the rows below saturation. ``--out`` (default
``plan-accuracy-out/``) gets ``report.md``, ``accuracy.json`` (every figure), ``profile.json`` and
each run's folder (``predicted/`` and ``measured/`` with their ``summary.json``, and logs).
``--predict-only`` runs the simulations only and compares them with the ``measured/`` folders
already in ``--out`` (a simulator change or a new profile, checked in seconds, no cluster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from peers_env import machine_info, pdserve_env
from peers_metrics import pdserve_records, w2_metrics
from peers_processes import busy_cores, free_port, run_logged, spawn, stop, stop_all, tail
from peers_servers import wait_ready
from phased_trace import write_phased_trace
from plan_accuracy_figures import SATURATION_RULES, compare, mark_saturation, parse_placements, report

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]


def _csv_floats(text: str) -> list[float]:
    values = sorted({float(x) for x in text.split(",") if x.strip()})
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates > 0, got {text!r}")
    return values


def _placements(text: str):
    try:
        return parse_placements(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/plan_accuracy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="plan-accuracy-out", help="output folder (default plan-accuracy-out)")
    p.add_argument("--profile", default=None, help="a pdserve profile JSON (default: run pdserve profile first)")
    p.add_argument("--model", default="embedded:llama-80m", help="model to profile and serve without --profile")
    p.add_argument("--dtype", default="float32", help="dtype to profile and serve without --profile (default float32)")
    p.add_argument(
        "--placements",
        type=_placements,
        default="colocated:2,split:1+1,auto:2",
        help="KIND:N (N workers) or KIND:P+D, comma-separated (default colocated:2,split:1+1,auto:2)",
    )
    p.add_argument("--workloads", default="w2,azure-conv,mooncake-conversation,phases", help="comma-separated")
    p.add_argument("--rates", type=_csv_floats, default="1,2,4,8", help="w2 rates, req/s (default 1,2,4,8)")
    p.add_argument("--trace-rates", type=_csv_floats, default="0.25,0.5", help="trace rates, req/s (default 0.25,0.5)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per run (default 100)")
    p.add_argument("--input-len", type=int, default=256, help="w2 prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=64, help="w2 and Mooncake output tokens (default 64)")
    p.add_argument("--max-input-tokens", type=int, default=1024, help="trace prompt cap, tokens (default 1024)")
    p.add_argument("--slo-ttft-ms", type=float, default=400.0, help="TTFT SLO (default 400)")
    p.add_argument("--slo-tpot-ms", type=float, default=40.0, help="TPOT SLO (default 40)")
    p.add_argument("--saturation", choices=SATURATION_RULES, default="load", help="saturation rule (default load)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts (default 0)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests after each cluster start (default 3)")
    p.add_argument("--datasets-dir", default=None, help="the datasets folder (default: pdserve's own lookup)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="per cluster start, s (default 600)")
    p.add_argument("--max-duration", type=float, default=900.0, help="per bench or simulate run, s (default 900)")
    p.add_argument(
        "--predict-only",
        action="store_true",
        help="run the simulations only; compare them with the measured/ folders already in --out (no cluster)",
    )
    p.add_argument(
        "--host-cores",
        type=float,
        default=float(len(os.sched_getaffinity(0))),
        help="simulate's --host-cores: the cores the measured cluster and bench share (default: this machine's usable)",
    )
    for tool in ("serve", "simulate", "profile"):
        p.add_argument(f"--{tool}-args", default="", help=f"extra flags for pdserve {tool}, one string")
    return p


def cpu_line() -> tuple[str, dict]:
    """``CPU: MODEL, N cores (U usable)``, the model from ``lscpu``, and the machine's description."""
    machine, model = machine_info(), None
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name:")), None)
    except (OSError, subprocess.SubprocessError):
        pass
    machine["lscpu_model_name"] = model or machine["cpu"]
    cores = f"{machine['cores']} cores ({machine['usable_cores']} usable)"
    return f"CPU: {machine['lscpu_model_name']}, {cores}; torch {machine['torch']}", machine


def workloads(args) -> tuple[list[tuple], list[str]]:
    """``(name, workload flags, rates, prefix caching off)`` per workload, and a note per skipped one."""
    common = ["--prompts", "random", "--num-requests", str(args.num_requests), "--seed", str(args.seed)]
    out, skipped = [], []
    for name in (w.strip() for w in args.workloads.split(",") if w.strip()):
        if name == "w2":
            flags = ["--arrival", "poisson", "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
            out.append((name, flags + common, args.rates, True))
            continue
        if name == "phases":  # a load that changes: benchmarks/phased_trace.py, at each of --trace-rates
            path = write_phased_trace(Path(args.out).resolve() / "phases.csv", args.num_requests, seed=args.seed)
            out.append((name, ["--arrival", "trace", "--trace", str(path), *common], args.trace_rates, True))
            continue
        from scheduling import CONVERSATION_SAMPLE, LENGTH_SCALE  # the scale the scheduling benchmark runs them at

        from pdserve.loadgen.dataset_files import dataset_file, resolve_datasets_dir
        from pdserve.loadgen.workload import TRACES

        if name not in TRACES:
            raise SystemExit(f"error: unknown workload {name!r}: w2 or one of {', '.join(TRACES)}")
        try:
            dataset_file(TRACES[name], args.datasets_dir)
        except FileNotFoundError as exc:
            skipped.append(f"{name} skipped: {exc}")
            print(skipped[-1], flush=True)
            continue
        flags = ["--arrival", "trace", "--trace", name, "--length-scale", f"{LENGTH_SCALE.get(name, 0.25):g}"]
        flags += ["--max-input-tokens", str(args.max_input_tokens)]
        flags += ["--datasets-dir", str(resolve_datasets_dir(args.datasets_dir).resolve())]  # the folder checked here
        if name in CONVERSATION_SAMPLE:  # Mooncake: a hashed sample keeps its shared prefixes; outputs fixed
            flags += ["--conversation-sample", f"{CONVERSATION_SAMPLE[name]:g}", "--output-len", str(args.output_len)]
        out.append((name, flags + common, args.trace_rates, False))
    return out, skipped


def _summary(folder: Path) -> dict:
    from pdserve.loadgen.metrics import read_summary

    return read_summary(json.loads((folder / "summary.json").read_text()))


def run_one(args, env: dict, setup: dict, workload: tuple, placement, rate: float, run_dir: Path) -> dict:
    """Simulate, then serve and bench, one workload at one placement and rate; the row's figures."""

    name, flags, _, no_cache = workload
    cache = ["--no-prefix-caching"] if no_cache else []
    load = [*flags, "--rate", f"{rate:g}", "--slo-ttft-ms", f"{args.slo_ttft_ms:g}"]
    load += ["--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    sim = [*PDSERVE, "simulate", "--profile", setup["profile"], *placement.flags(), *cache, *load]
    sim += ["--host-cores", f"{args.host_cores:g}", "--out", str(run_dir / "predicted")]
    sim += shlex.split(args.simulate_args)
    rc = run_logged(sim, run_dir / "simulate.log", args.max_duration, env)
    if rc not in (0, 1) or not (run_dir / "predicted" / "summary.json").is_file():  # 1: some requests failed
        raise RuntimeError(f"pdserve simulate exit {rc}: {tail(run_dir / 'simulate.log', 1)}")
    measured_dir = run_dir / "measured"
    if args.predict_only:
        if not (measured_dir / "summary.json").is_file():
            raise RuntimeError(f"--predict-only: no earlier measurement in {measured_dir}")
        return _rows(args, run_dir, measured_dir, math.nan)
    port, log = free_port(), run_dir / "serve.log"
    serve = [*PDSERVE, "serve", "--model", setup["model"], "--dtype", setup["dtype"], *placement.flags(), *cache]
    serve += ["--cpus-per-worker", "1", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0"]
    proc = spawn([*serve, *shlex.split(args.serve_args)], log, env)
    try:
        wait_ready(proc, log, args.start_timeout, lambda: b"serving on" in log.read_bytes())
        bench = [*PDSERVE, "bench", "--router", f"127.0.0.1:{port}", "--max-duration", f"{args.max_duration:g}"]
        bench += ["--tokenizer", setup["model"]] if Path(setup["model"]).exists() else []
        if args.warmup:
            warm = ["--arrival", "poisson", "--rate", "100", "--num-requests", str(args.warmup), "--prompts", "random"]
            warm += ["--input-len", str(args.input_len), "--output-len", "8", "--seed", str(args.seed + 1000)]
            run_logged([*bench, *warm, "--out", str(run_dir / "warmup")], run_dir / "warmup.log", 600, env)
        busy = busy_cores()  # the cluster idles now: this is everything else on the machine
        rc = run_logged(
            [*bench, *load, "--out", str(run_dir / "measured")], run_dir / "bench.log", args.max_duration + 120, env
        )
    finally:
        stop(proc)
    if rc not in (0, 1) or not (measured_dir / "summary.json").is_file():
        raise RuntimeError(f"pdserve bench exit {rc}: {tail(run_dir / 'bench.log', 1)}")
    return _rows(args, run_dir, measured_dir, busy)


def _rows(args, run_dir: Path, measured_dir: Path, busy: float) -> dict:
    from pdserve.loadgen.metrics import SLO

    measured = _summary(measured_dir)
    records, duration, _ = pdserve_records(measured_dir / "results.jsonl", measured)
    load_figs = w2_metrics(records, duration, SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
    measured.update({k: load_figs[k] for k in ("offered_rps", "completion_rps", "sustained")}, busy_cores_before=busy)
    predicted = _summary(run_dir / "predicted")
    return {"figures": compare(predicted, measured), "measured": measured, "predicted": predicted}


def get_profile(args, env: dict, out: Path) -> dict:
    """The profile's path, model and dtype: ``--profile`` (copied into ``out``), else a new one."""
    path = out / "profile.json"
    if args.profile:
        if Path(args.profile).resolve() != path.resolve():
            shutil.copyfile(args.profile, path)
    else:
        print(f"profiling {args.model} ({args.dtype}) into {path} (minutes)", flush=True)
        cmd = [*PDSERVE, "profile", "--model", args.model, "--dtype", args.dtype, "--out", str(path)]
        rc = run_logged([*cmd, *shlex.split(args.profile_args)], out / "profile.log", 3600, env)
        if rc != 0:
            raise SystemExit(f"error: pdserve profile exit {rc}:\n{tail(out / 'profile.log')}")
    profile = json.loads(path.read_text())
    return {"profile": str(path), "model": profile["settings"]["model_spec"], "dtype": profile["machine"]["dtype"]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_hex(16))  # lets bench read workers' stats
    env = pdserve_env()
    cpu, machine = cpu_line()
    print(cpu, flush=True)
    rows: list[dict] = []
    info = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine, "rows": rows}
    info["args"] = {**vars(args), "placements": [p.text for p in args.placements]}
    code, setup, skipped = 0, {}, []
    try:
        setup = get_profile(args, env, out)
        plan, skipped = workloads(args)
        for workload in plan:
            for placement in args.placements:
                for rate in workload[2]:
                    row = {"workload": workload[0], "placement": placement.text, "rate_rps": rate}
                    run_dir = out / workload[0] / placement.text.replace(":", "-").replace("+", "p") / f"rate_{rate:g}"
                    print(f"{workload[0]} {placement.text} @ {rate:g} req/s ...", flush=True)
                    try:
                        row.update(run_one(args, env, setup, workload, placement, rate, run_dir))
                        row["busy_cores_before"] = row["measured"]["busy_cores_before"]
                    except RuntimeError as exc:
                        lines = str(exc).strip().splitlines() or ["?"]  # what failed, and the log's last line
                        row["error"] = " ".join(dict.fromkeys([lines[0], lines[-1].strip()]))[:240]
                        print(f"  failed: {exc}", flush=True)
                    rows.append(row)
    except KeyboardInterrupt:
        print("interrupted: stopping every process and writing what finished", file=sys.stderr, flush=True)
        code = info["interrupted"] = 130
    finally:
        stop_all()
    mark_saturation(rows, args.saturation)
    slo = f"SLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    header = [
        cpu,
        "",
        f"Model {setup.get('model', '?')}, {setup.get('dtype', '?')}; profile {setup.get('profile', '-')}",
    ]
    header += [f"{slo}; saturation rule: {args.saturation}; {args.num_requests} requests a run", *skipped, ""]
    header += ["Each cell: predicted / measured (relative error, (predicted - measured) / measured)."]
    text = report(header, rows)
    info.update(setup=setup, skipped=skipped)
    from pdserve.loadgen.metrics import json_safe

    (out / "accuracy.json").write_text(json.dumps(json_safe(info), indent=2))
    (out / "report.md").write_text(text)
    print("\n" + text)
    return code


if __name__ == "__main__":
    sys.exit(main())
