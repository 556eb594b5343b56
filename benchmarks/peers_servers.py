"""W2 servers and clients of ``benchmarks/peers.py``: ``vllm serve`` measured with ``vllm bench serve``,
``pdserve serve`` measured with ``pdserve bench``, one at a time on 127.0.0.1, and the shared Poisson
schedule both clients send on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from peers_env import pdserve_env, vllm_env
from peers_metrics import pdserve_records, vllm_records
from peers_processes import free_port, run_logged, spawn, tail

WORKERS = Path(__file__).resolve().parent / "peers_workers.py"  # runs vLLM's CLI with its version lookup fixed


def wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float, ready) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready:\n{tail(log)}")
        if ready():
            return
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout_s:.0f}s:\n{tail(log)}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_server(system: str, args, model_dir: Path, out: Path, vllm_py: Path | None):
    port = free_port()
    log = out / "logs" / f"w2-{system}-server.log"
    offset = log.stat().st_size if log.exists() else 0  # logs are appended to: look at this run's lines only
    if system == "vllm":
        cmd = [
            str(vllm_py),
            str(WORKERS),
            "_vllm-cli",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            args.serve_dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--no-enable-prefix-caching",
            "--seed",
            "0",
            "--stream-interval",
            str(args.stream_interval),
        ]
        proc = spawn(cmd, log, vllm_env(args))
        wait_ready(proc, log, args.start_timeout, lambda: http_ok(f"http://127.0.0.1:{port}/health"))
    else:
        placement = system.split("-", 1)[1]
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli.main",
            "serve",
            "--placement",
            placement,
            "--cpus-per-worker",
            "1",
            "--port",
            str(port),
            "--model",
            str(model_dir),
            "--dtype",
            args.serve_dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--kv-cache-gib",
            str(args.kv_cache_gib),
            "--no-prefix-caching",  # as vLLM: every rate sends the same prompts to this one server
            "--http-port",
            "0",
            "--stream-interval",
            str(args.stream_interval),
        ]  # the gRPC client drives it
        proc = spawn(cmd, log, pdserve_env())
        wait_ready(proc, log, args.start_timeout, lambda: b"serving on" in log.read_bytes()[offset:])
    return proc, port, log


def bench_vllm(args, model_dir: Path, port: int, rate: float, run_dir: Path, vllm_py: Path) -> tuple:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(vllm_py),
        str(WORKERS),
        "_vllm-cli",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        str(model_dir),
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--request-rate",
        f"{rate:g}",
        "--num-prompts",
        str(args.num_requests),
        "--seed",
        str(args.seed),
        "--num-warmups",
        "2",
        "--goodput",
        f"ttft:{args.slo_ttft_ms:g}",
        f"tpot:{args.slo_tpot_ms:g}",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(run_dir),
        "--result-filename",
        "result.json",
        "--disable-tqdm",
    ]
    log = run_dir / "client.log"
    rc = run_logged(cmd, log, args.max_duration + 300, vllm_env(args))
    path = run_dir / "result.json"
    if rc != 0 or not path.is_file():
        raise RuntimeError(f"vllm bench serve exit {rc}:\n{tail(log)}")
    return vllm_records(json.loads(path.read_text()))


def vllm_schedule(rate: float, num: int, seed: int) -> list[float]:
    """The send times ``vllm bench serve --request-rate RATE --num-prompts NUM --seed SEED`` uses:
    ``np.random.seed(seed)``, NUM gamma(1, 1/RATE) gaps (Poisson), summed, rescaled so the last
    send is at NUM/RATE. Re-based here so the first send is at 0."""
    import numpy as np

    state = np.random.get_state()
    try:
        np.random.seed(seed)
        gaps = [np.random.gamma(shape=1.0, scale=1.0 / rate) for _ in range(num)]
    finally:
        np.random.set_state(state)
    times = np.cumsum(gaps)
    times *= (num / rate) / times[-1]
    return [float(t - times[0]) for t in times]


def write_schedule(path: Path, times: list[float], input_len: int, output_len: int) -> Path:
    """``times`` as an Azure-format trace CSV (what ``pdserve bench --arrival trace`` replays)."""
    from datetime import datetime, timedelta

    base = datetime(2024, 1, 1)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [
        f"{(base + timedelta(seconds=t)).strftime('%Y-%m-%d %H:%M:%S.%f')},{input_len},{output_len}" for t in times
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def _pdserve_bench_cmd(
    args, model_dir: Path, port: int, arrival: list[str], num: int, seed: int, run_dir: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdserve.cli.main",
        "bench",
        "--router",
        f"127.0.0.1:{port}",
        "--tokenizer",
        str(model_dir),  # the served model's id need not name a folder here
        *arrival,
        "--num-requests",
        str(num),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--prompts",
        "random",
        "--seed",
        str(seed),
        "--slo-ttft-ms",
        f"{args.slo_ttft_ms:g}",
        "--slo-tpot-ms",
        f"{args.slo_tpot_ms:g}",
        "--max-duration",
        f"{args.max_duration:g}",
        "--out",
        str(run_dir),
    ]


def bench_pdserve(args, model_dir: Path, port: int, rate: float, run_dir: Path, warm: bool) -> tuple:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "client.log"
    if not warm:  # as vllm bench serve: one test request and two warm-up requests before the first rate
        rc = run_logged(
            _pdserve_bench_cmd(
                args,
                model_dir,
                port,
                ["--arrival", "poisson", "--rate", "100"],
                3,
                args.seed + 1000,
                run_dir / "warmup",
            ),
            log,
            args.max_duration + 120,
            pdserve_env(),
        )
        if rc != 0:
            raise RuntimeError(f"pdserve bench warm-up exit {rc}:\n{tail(log)}")
    if args.schedule == "shared":
        trace = write_schedule(
            run_dir / "schedule.csv", vllm_schedule(rate, args.num_requests, args.seed), args.input_len, args.output_len
        )
        arrival = ["--arrival", "trace", "--trace", str(trace)]
    else:
        arrival = ["--arrival", "poisson", "--rate", f"{rate:g}"]
    rc = run_logged(
        _pdserve_bench_cmd(args, model_dir, port, arrival, args.num_requests, args.seed, run_dir),
        log,
        args.max_duration + 120,
        pdserve_env(),
    )
    if rc not in (0, 1) or not (run_dir / "summary.json").is_file():  # 1: some requests failed
        raise RuntimeError(f"pdserve bench exit {rc}:\n{tail(log)}")
    return pdserve_records(run_dir / "results.jsonl", json.loads((run_dir / "summary.json").read_text()))
