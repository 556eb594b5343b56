"""The hardware and software a profile was measured on (the ``machine`` section of ``pdserve profile``)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from pdserve.engine.llm_engine import LLMEngine

CPU_FLAGS = ("avx2", "avx512f", "amx_bf16")


def machine(engine: LLMEngine) -> dict:
    """The hardware and software the profile was measured on."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    device = engine.runner.device
    return {
        "cpu_model": model or platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "torch_version": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": engine.runner.dtype_name,
        "attention_backend": engine.runner.model.attention.name,
        "model": engine.model_dir.name,
        "model_fingerprint": engine.fingerprint.digest(),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
