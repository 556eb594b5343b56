#!/usr/bin/env python3
"""One prompt's prefill, part by part, beside the GEMM peak measured in the same run.

    python benchmarks/prefill_profile.py [--model embedded:llama-80m] [--dtype bfloat16] [--lens 256 1024]
        [--repeats 5] [--threads N] [--attention-backend auto|sdpa-prefill|...]
        [--linear-kernel auto|onednn|dense] [--amx-attention on|off]

For each prompt length, a prompt of that many random tokens is prefilled alone (one engine step,
max_tokens 1) ``--repeats`` times after two warm-ups, and the fastest step is reported with its
parts timed as ``decode_profile.py`` times them (linears, lm_head, the attention kernel's prefill,
elementwise, the rest). The achieved rate is the model's FLOPs (the linears' 2 x weights per token,
plus causal attention's QK^T and PV) over the step's time; the peak is an [n, hidden] x [hidden,
intermediate] GEMM at the same row count, the faster of the engine's own linear (as ``pdserve
throughput`` measures it) and oneDNN's packed GEMM, whatever ``--linear-kernel`` picks. Prints the
CPU beside the figures.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from decode_profile import (
    Timers,
    add_kernel_flags,
    cpu_name,
    instrument_classes,
    instrument_engine,
    use_kernels,
)

from pdserve.cli.throughput import matmul_tflops, model_flops_per_token
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models import attention
from pdserve.engine.models import linear as engine_linear
from pdserve.engine.params import SamplingParams
from pdserve.worker.flags import non_negative_int, positive_int


def prefill_flops(engine: LLMEngine, n: int) -> float:
    """FLOPs of one n-token prefill: the linears' (lm_head on the last token only) plus causal attention."""
    mc = engine.model_cfg
    linear = n * (model_flops_per_token(mc) - 2 * mc.hidden_size * mc.vocab_size) + 2 * mc.hidden_size * mc.vocab_size
    attn = 2 * mc.num_layers * mc.num_heads * mc.head_dim * n * (n + 1)  # QK^T and PV over the causal half
    return linear + attn


def gemm_peak(rows: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> float:
    """TFLOP/s of x [rows, k] @ w [n, k].T: the faster of the engine's own linear and oneDNN's packed
    GEMM, so that the peak does not move with ``--linear-kernel``."""
    own = matmul_tflops(rows, k, n, dtype, device)
    chosen, engine_linear.dense_linear = engine_linear.dense_linear, lambda weight, bias: None
    try:
        onednn = matmul_tflops(rows, k, n, dtype, device)
    finally:
        engine_linear.dense_linear = chosen
    return max(own, onednn)


def profile_len(engine: LLMEngine, timers: Timers, n: int, repeats: int) -> None:
    rng = random.Random(n)
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best, parts = float("inf"), {}
    for i in range(repeats + 2):
        engine.add_request(f"p{n}-{i}", [rng.randrange(engine.model_cfg.vocab_size) for _ in range(n)], sampling)
        timers.seconds.clear()
        timers.on = i >= 2
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        timers.on = False
        while engine.has_work():
            engine.step()
        if i >= 2 and wall < best:
            best, parts = wall, dict(timers.seconds)
    mc, runner = engine.model_cfg, engine.runner
    peak = gemm_peak(n, mc.hidden_size, mc.intermediate_size, runner.dtype, runner.device)
    rate = prefill_flops(engine, n) / best / 1e12
    ms = {k: v * 1e3 for k, v in parts.items()}
    linear = ms.get("linear", 0.0) - ms.get("lm_head", 0.0)
    rest = ms.get("forward", 0.0) - ms.get("linear", 0.0) + ms.get("lm_head", 0.0)
    rest -= ms.get("attention", 0.0) + ms.get("elementwise", 0.0)
    print(
        f"\nprefill of {n} tokens: {best * 1e3:.1f} ms, {rate:.2f} TFLOP/s = {rate / peak:.0%} of the GEMM peak "
        f"({peak:.2f} TFLOP/s at {n} rows)"
    )
    linear_rate = n * (model_flops_per_token(mc) - 2 * mc.hidden_size * mc.vocab_size) / (linear / 1e3) / 1e12
    rows = [
        ("linears", linear, f"{linear_rate:.2f} TFLOP/s"),
        ("lm_head", ms.get("lm_head", 0.0), ""),
        ("attention", ms.get("attention", 0.0), ""),
        ("elementwise", ms.get("elementwise", 0.0), ""),
        ("forward other", rest, ""),
        ("outside forward", best * 1e3 - ms.get("forward", 0.0) - ms.get("lm_head", 0.0), ""),
    ]
    for name, value, note in rows:
        print(f"  {name:<16}{value:9.2f} ms {value / (best * 1e3):6.0%}  {note}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:llama-80m", help="as pdserve's --model (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--lens", type=positive_int, nargs="+", default=[256, 1024], help="prompt lengths (tokens)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed prefills per length; the fastest counts")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--attention-backend", default="auto", choices=attention.BACKENDS, help="as pdserve's")
    add_kernel_flags(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = use_kernels(args)
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_kv_blocks=-(-max(args.lens) // 16) + 8,
        max_num_batched_tokens=max(2048, max(args.lens)),
        enable_prefix_caching=False,
        torch_threads=args.threads,
        attention_backend=args.attention_backend,
    )
    try:
        engine = LLMEngine(cfg)
    except (ValueError, FileNotFoundError) as exc:  # a model the engine refuses
        p.error(str(exc))
    window = engine.model_cfg.max_position_embeddings
    too_long = [n for n in args.lens if n >= window]
    if too_long:
        p.error(f"--lens {too_long[0]}: the model's context window is {window} tokens")
    timers = Timers()
    instrument_engine(engine, timers)
    instrument_classes(timers, type(engine.runner.model.ops))
    timers.wrap(attention.TorchAttention, "prefill", "attention")  # the C++ backend's prefill is its decode
    backend = engine.runner.model.attention.name
    print(f"CPU: {cpu_name()}; model {args.model}, {engine.runner.dtype_name}, attention {backend}; {chosen}")
    for n in args.lens:
        profile_len(engine, timers, n, args.repeats)


if __name__ == "__main__":
    main()
