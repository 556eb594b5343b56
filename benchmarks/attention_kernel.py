#!/usr/bin/env python3
"""The paged attention kernel alone (``cpu-paged``), decode and prefill, beside the read bound.

    python benchmarks/attention_kernel.py [--model-shape llama-80m|smollm2-135m] [--dtype bfloat16]
        [--batch 32] [--context 256 1024] [--prompt-lens 256 1024,100,30] [--threads 1 2] [--repeats 20]

Decode: ``--batch`` sequences of ``--context`` positions each attend once in every layer, through
``CpuPagedAttention.decode`` on caches of random K/V with every sequence's blocks scattered at
random (as a long-running server's block tables are). Two figures a case, in milliseconds for all
layers: ``cold``, each layer with its own cache (the caches together far larger than L3, as in a
real step), and ``hot``, every layer on layer 0's cache (the work alone, what the kernel costs with
the reads out of the way where the cache fits L3). The bound is reading every layer's K and V once
at the bandwidth the read probe (``pdserve throughput``'s) measures in the same run.

Prefill: one step of prompts of the given lengths (comma-separated: several sequences in one
step), each query row attending causally to its own prompt, all layers.

Prints the CPU (lscpu's model name, AMX or not) beside the figures; the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil
import torch
from decode_profile import cpu_name

from pdserve.cli.throughput import memory_gbps
from pdserve.engine.models.attention import AttentionMetadata, CpuPagedAttention

SHAPES = {  # layers, query heads, KV heads, head_dim
    "llama-80m": (12, 12, 4, 64),
    "smollm2-135m": (30, 9, 3, 64),
}
BLOCK_SIZE = 16


def paged_case(lens: list[int], layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, shared: bool):
    """Caches [2, num_blocks, BLOCK_SIZE, kv_heads, head_dim] per layer (layer 0's for all when
    ``shared``), block tables with each sequence's blocks at random, and the lengths."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(need)
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    caches = [first if shared or i == 0 else torch.randn(first.shape).to(dtype) for i in range(layers)]
    perm = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n]
        at += n
    return caches, tables


def time_layers(backend, q, caches, meta, repeats: int) -> float:
    """Median seconds of one call per layer, after two warm-up rounds."""
    for _ in range(2):
        for c in caches:
            backend.decode(q, c[0], c[1], meta)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for c in caches:
            backend.decode(q, c[0], c[1], meta)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_decode(args, dtype, shape, batch: int, context: int, bandwidth: float) -> None:
    layers, heads, kv_heads, head_dim = shape
    backend = CpuPagedAttention(head_dim**-0.5, None, dtype)
    lens = [context] * batch
    q = torch.randn(batch, heads, head_dim).to(dtype)
    figures = {}
    for label, shared in (("cold", False), ("hot", True)):
        caches, tables = paged_case(lens, layers, kv_heads, head_dim, dtype, shared)
        meta = AttentionMetadata(
            False,
            torch.zeros(batch, dtype=torch.int64),
            tables,
            torch.tensor(lens, dtype=torch.int32),
            torch.arange(batch + 1, dtype=torch.int32),
        )
        figures[label] = time_layers(backend, q, caches, meta, args.repeats)
    kv_bytes = layers * 2 * batch * context * kv_heads * head_dim * q.element_size()
    bound = kv_bytes / bandwidth / 1e9
    print(
        f"decode batch {batch} x {context} positions: cold {figures['cold'] * 1e3:.2f} ms "
        f"({kv_bytes / figures['cold'] / 1e9:.1f} GB/s, {bound / figures['cold']:.0%} of the read bound "
        f"{bound * 1e3:.2f} ms), hot {figures['hot'] * 1e3:.2f} ms"
    )


def run_prefill(args, dtype, shape, lens: list[int]) -> None:
    layers, heads, kv_heads, head_dim = shape
    backend = CpuPagedAttention(head_dim**-0.5, None, dtype)
    caches, tables = paged_case(lens, layers, kv_heads, head_dim, dtype, False)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        True,
        torch.zeros(cu[-1], dtype=torch.int64),
        tables,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        cu_seqlens=cu,
    )
    q = torch.randn(cu[-1], heads, head_dim).to(dtype)
    seconds = time_layers(backend, q, caches, meta, max(3, args.repeats // 4))
    flops = sum(4 * layers * heads * head_dim * n * (n + 1) / 2 for n in lens)  # QK^T and PV, causal
    print(f"prefill {','.join(map(str, lens))} tokens: {seconds * 1e3:.2f} ms ({flops / seconds / 1e9:.0f} GFLOP/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="llama-80m")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--prompt-lens", nargs="+", default=["256", "1024,100,30"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.batch < 1 or min(args.context) < 1 or min(args.threads) < 1 or args.repeats < 1:
        ap.error("--batch, --context, --threads and --repeats must be at least 1")
    try:
        prompts = [[int(n) for n in spec.split(",")] for spec in args.prompt_lens]
    except ValueError:
        ap.error("--prompt-lens takes comma-separated token counts, e.g. 256 or 1024,100,30")
    if any(n < 1 for p in prompts for n in p):
        ap.error("--prompt-lens must be at least 1 token each")
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.model_shape]
    cores = os.cpu_count() or 1
    if max(args.threads) > cores:
        ap.error(
            f"--threads {max(args.threads)} is more than this machine's {cores} cores: the figures would mean nothing"
        )
    layers, _, kv_heads, head_dim = shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = layers * 2 * args.batch * max(args.context) * kv_heads * head_dim * itemsize
    free = psutil.virtual_memory().available
    if need > 0.8 * free:
        ap.error(
            f"--batch {args.batch} x --context {max(args.context)} needs {need / 2**30:.1f} GiB of KV caches, more "
            f"than this machine has free ({free / 2**30:.1f} GiB)"
        )
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = memory_gbps(torch.device("cpu"))
        print(
            f"CPU: {cpu_name()}; read probe {bandwidth:.1f} GB/s; {args.model_shape} shape: {layers} layers, "
            f"{shape[1]} query heads, {kv_heads} KV heads, head_dim {head_dim}; {args.dtype}"
        )
        for context in args.context:
            run_decode(args, dtype, shape, args.batch, context, bandwidth)
        for lens in prompts:
            run_prefill(args, dtype, shape, lens)


if __name__ == "__main__":
    main()
