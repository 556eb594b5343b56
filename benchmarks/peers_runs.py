"""The two workloads of ``benchmarks/peers.py``, system by system: W1 offline throughput (each
system's batch generate call in a subprocess) and W2 serving (a server per system, a client run per
rate). Each appends its results as they come, so an interrupted run keeps what finished."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from peers_env import pdserve_env, vllm_env
from peers_metrics import pooled_metrics, w2_metrics
from peers_probe import machine_probe
from peers_processes import OtherLoad, busy_cores, run_logged, session_cpu_s, stop, stop_all, tail
from peers_servers import WORKERS, bench_pdserve, bench_vllm, start_server, vllm_schedule

from pdserve.loadgen.metrics import SLO


def run_w1(args, model_dir: Path, out: Path, vllm_py: Path | None, rows: list[dict]) -> list[dict]:
    """Append one row per (dtype, system) to ``rows`` (so an interrupted run keeps what finished)."""
    tokens = args.num_prompts * (args.input_len + args.output_len)
    spec_base = {
        "model_dir": str(model_dir),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
    }
    systems = (["vllm"] if vllm_py else []) + ["pdserve"] + ([] if args.skip_hf else ["transformers"])
    for dtype in args.dtypes:
        for system in systems:
            tag = f"{system}-{dtype}"
            log, result_path = out / "logs" / f"w1-{tag}.log", out / "w1" / f"{tag}.json"
            result_path.parent.mkdir(parents=True, exist_ok=True)
            row = {"dtype": dtype, "system": system}
            print(f"W1 {tag}: {args.num_prompts} x {args.input_len} -> {args.output_len}...", flush=True)
            if system == "pdserve":
                cmd = [
                    sys.executable,
                    "-m",
                    "pdserve.cli.main",
                    "throughput",
                    "--model",
                    str(model_dir),
                    "--num-prompts",
                    str(args.num_prompts),
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                    "--dtype",
                    dtype,
                    "--seed",
                    str(args.seed),
                    "--max-model-len",
                    str(args.max_model_len),
                    "--kv-cache-gib",
                    str(args.kv_cache_gib),
                    "--no-prefix-caching",  # as in vLLM: the warm-up prefills 16-token starts of measured prompts
                    "--json",
                    str(result_path),
                ]
                env = pdserve_env()
            else:
                spec_path = out / "w1" / f"{tag}.spec.json"
                spec_path.write_text(json.dumps({**spec_base, "dtype": dtype}))
                py = str(vllm_py) if system == "vllm" else sys.executable
                cmd = [py, str(WORKERS), "_w1", system, str(spec_path), str(result_path)]
                env = vllm_env(args) if system == "vllm" else pdserve_env()
            t = time.monotonic()
            with OtherLoad() as load:
                rc = run_logged(cmd, log, args.w1_timeout, env)
            row["run_s"], row["other_cores"] = time.monotonic() - t, load.cores
            if rc != 0 or not result_path.is_file():
                row["error"] = f"exit {rc}" + (" (timed out)" if rc == 124 else "") + f"; see {log}"
                print(f"  failed: {row['error']}\n{tail(log)}", flush=True)
            else:
                raw = json.loads(result_path.read_text())
                row["raw"] = raw
                row["elapsed_s"] = raw["elapsed_s"]
                row["total_tokens_per_s"] = raw.get("total_tokens_per_s", tokens / raw["elapsed_s"])
                row["prefill_tokens_per_s"] = raw.get("prefill_tokens_per_s")
                row["decode_step_ms"] = raw.get("decode_step_ms")
                print(f"  {row['total_tokens_per_s']:.0f} tok/s ({row['elapsed_s']:.2f} s)", flush=True)
            rows.append(row)
    return rows


def run_w2(args, model_dir: Path, out: Path, vllm_py: Path | None, results: dict) -> dict:
    """Fill ``results`` per system and rate (so an interrupted run keeps what finished).

    With ``args.rounds`` > 1 the sweep runs that many times, the systems in turn and the order
    reversed every other round (ABBA), so a machine that drifts over the run meets every system at
    about the same mean time. ``results[system]["rates"][rate]`` then pools every round's requests
    (:func:`peers_metrics.pooled_metrics`) and ``results[system]["rounds"]`` keeps each round's own."""
    systems = (["vllm"] if vllm_py else []) + [f"pdserve-{p}" for p in args.pdserve_placements]
    slo = SLO(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)
    runs: dict[tuple[str, str], list] = {}  # (system, rate) -> [(records, w2_metrics)] by round
    for r in range(args.rounds):
        for system in round_order(systems, r):
            per = results.setdefault(system, {"rates": {}, "rounds": [], "probes": []})
            _run_system(args, model_dir, out, vllm_py, system, r, per, runs, slo)
    return results


def round_order(systems: list[str], round_index: int) -> list[str]:
    """The systems in the order round ``round_index`` (from 0) runs them: as given in even rounds,
    reversed in odd ones (A B C, C B A, A B C, ...)."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def _run_system(args, model_dir, out, vllm_py, system, round_index, per, runs, slo) -> None:
    """Start ``system``'s server, run every rate of round ``round_index`` (from 0) against it, stop it."""
    probe = machine_probe()  # before its server: the machine alone
    per["probes"].append(probe)
    per.setdefault("probe", probe)  # the first round's
    figures = {}
    per["rounds"].append(figures)
    label = f"W2 {system}" + (f", round {round_index + 1} of {args.rounds}" if args.rounds > 1 else "")
    print(
        f"{label}: machine probe {probe['read_gbps']:.1f} GB/s, {probe['bf16_tflops']:.2f} TFLOP/s (one thread); "
        f"starting the server ({args.serve_dtype})...",
        flush=True,
    )
    t = time.monotonic()
    try:
        proc, port, log = start_server(system, args, model_dir, out, vllm_py)
    except RuntimeError as exc:
        per["error"] = f"server failed to start: {exc}"
        print(f"  {per['error']}", flush=True)
        stop_all()
        return
    per.setdefault("start_s", time.monotonic() - t)
    print(f"  ready on 127.0.0.1:{port} in {time.monotonic() - t:.0f}s", flush=True)
    try:
        for i, rate in enumerate(args.rates):
            key = f"{rate:g}"
            run_dir = out / "w2" / system / (f"round_{round_index + 1}" if args.rounds > 1 else "") / f"rate_{key}"
            busy_before = busy_cores()  # the server idles now: this is everything else on the machine
            cpu_before = session_cpu_s(proc.pid)
            try:
                if system == "vllm":
                    records, duration, reported = bench_vllm(args, model_dir, port, rate, run_dir, vllm_py)
                else:
                    records, duration, reported = bench_pdserve(args, model_dir, port, rate, run_dir, warm=i > 0)
            except RuntimeError as exc:
                figures[key] = {"error": str(exc)}
                per["rates"].setdefault(key, figures[key])
                print(f"  {rate:g} req/s failed: {exc}", flush=True)
                continue
            m = figures[key] = w2_metrics(records, duration, slo)
            m["busy_cores_before"], m["client_reported"] = busy_before, reported  # the client's own figures
            m["cpu_ms_per_output_token"] = cpu_per_token(cpu_before, session_cpu_s(proc.pid), records)
            planned = vllm_schedule(rate, args.num_requests, args.seed)
            if args.schedule == "shared" or system == "vllm":  # how far the sends were from the shared plan
                sent = sorted(r.sent_s for r in records)
                m["send_vs_schedule_max_ms"] = max(abs(a - sent[0] - b) for a, b in zip(sent, planned)) * 1e3
                if m["send_vs_schedule_max_ms"] > 100:
                    print(
                        f"  warning: sends were up to {m['send_vs_schedule_max_ms']:.0f} ms off the shared schedule",
                        flush=True,
                    )
            runs.setdefault((system, key), []).append((records, m))
            per["rates"][key] = m if args.rounds == 1 else pooled_metrics(runs[(system, key)], slo)
            print(
                f"  rate_rps {rate:g}: request_throughput_rps {m['request_throughput_rps']:.2f}, goodput_rps "
                f"{m['goodput_rps']:.2f}, ttft_p90_ms {m['ttft_p90_s'] * 1e3:.0f}, tpot_p90_ms "
                f"{m['tpot_p90_s'] * 1e3:.1f}, "
                f"failed {m['failed']}",
                flush=True,
            )
            cpu = m["cpu_ms_per_output_token"]
            by_kind = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
            print(f"    server CPU ms per output token: {by_kind}", flush=True)
    finally:
        stop(proc)


def cpu_per_token(before: dict[str, float], after: dict[str, float], records) -> dict[str, float]:
    """CPU milliseconds per output token that the server's processes used over one rate's run, by
    kind (largest first), then their total; ``before`` / ``after`` are :func:`session_cpu_s`
    snapshots (a process that ended meanwhile is not counted). The load generator is left out: its
    process's figure would mostly be its start-up (``vllm bench serve`` imports vLLM)."""
    tokens = sum(r.output_tokens for r in records if r.ok) or 1
    per = {k: (after[k] - before.get(k, 0.0)) * 1e3 / tokens for k in after}
    per = dict(sorted(((k, v) for k, v in per.items() if v > 0), key=lambda kv: -kv[1]))
    return {**per, "total": sum(per.values())}
