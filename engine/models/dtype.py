"""``--dtype auto``: which dtype a model runs in on a device, and why."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# /proc/cpuinfo flags of CPUs with native bfloat16 matmul: Intel AMX, AVX512-BF16 (Intel, AMD Zen 4+),
# and Arm's BF16 extension
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        f
        for line in text.splitlines()
        if line.startswith(("flags", "Features"))
        for f in line.partition(":")[2].split()
    )


def has_amx() -> bool:
    """Whether the CPU has AMX bfloat16 tiles (``amx_bf16``): oneDNN's GEMM runs on them."""
    return "amx_bf16" in cpu_flags()


def native_bf16(device: torch.device) -> str | None:
    """The hardware feature that gives ``device`` native bfloat16 matmul, or None.

    CUDA: compute capability >= 8.0 (Ampere). CPU: one of ``_BF16_CPU_FLAGS`` in /proc/cpuinfo.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"CUDA sm{major}{minor}" if major >= 8 else None
    flags = cpu_flags()
    return next((f for f in _BF16_CPU_FLAGS if f in flags), None)


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device) -> tuple[str, str]:
    """(dtype name, reason) for ``requested`` (``"auto"`` or a dtype name).

    ``auto`` keeps the checkpoint's dtype, except that float32 checkpoints run in bfloat16 where
    the hardware has native bfloat16 matmul (``native_bf16``), and float16 checkpoints on a CPU run
    in bfloat16 there too (else float32): CPU GEMM libraries have no fast float16 path without
    AVX512-FP16. An explicit dtype is used as asked.
    """
    if requested != "auto":
        return requested, "as asked by --dtype"
    feature = native_bf16(device)
    if checkpoint_dtype == "float32" and feature:
        return "bfloat16", f"float32 checkpoint, native bfloat16 matmul ({feature}); --dtype float32 keeps float32"
    if checkpoint_dtype == "float16" and device.type == "cpu":
        target = "bfloat16" if feature else "float32"
        return target, f"float16 checkpoint on a CPU, which has no fast float16 GEMM; running {target}"
    why = "no native bfloat16 matmul on this device" if checkpoint_dtype == "float32" else "the checkpoint's dtype"
    return checkpoint_dtype, f"{checkpoint_dtype} checkpoint, {why}"
