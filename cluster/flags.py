"""Command-line flags about Ray placement, shared by ``pdserve serve`` and ``pdserve soak``, and the
check of what they ask of a local machine."""

from __future__ import annotations

import argparse


def add_role_resource_args(p: argparse.ArgumentParser) -> None:
    """--prefill-resource/--decode-resource: pin each split role to the Ray nodes offering a custom resource."""
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-resource",
            default=None,
            metavar="NAME",
            help=f"split: run {role} workers only on Ray nodes that offer this custom resource, one "
            f"unit per worker (`ray start --resources '{{\"NAME\": N}}'`)",
        )


def check_local_kv_fits(cfg) -> None:
    """ValueError (one line) before Ray starts when the CPU workers' KV caches (``--kv-cache-gib``
    each, where ``--num-kv-blocks`` sets none) exceed this machine's available memory."""
    import psutil
    import torch

    engine, workers = cfg.engine, cfg.num_prefill + cfg.num_decode
    on_gpu = cfg.device == "cuda" or (cfg.device is None and torch.cuda.is_available())
    if on_gpu or engine.num_kv_blocks is not None:
        return
    free = psutil.virtual_memory().available / (1 << 30)
    if engine.kv_cache_gib * workers > free:
        raise ValueError(
            f"--kv-cache-gib {engine.kv_cache_gib:g}: {workers} worker{'s' if workers != 1 else ''} would hold "
            f"{engine.kv_cache_gib * workers:g} GiB of KV cache; this machine has {free:.1f} GiB available"
        )
