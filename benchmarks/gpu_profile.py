#!/usr/bin/env python3
"""Where a CUDA engine step's time goes: W1's prefill steps and decode steps under torch.profiler.

    python benchmarks/gpu_profile.py [--model embedded:llama-80m] [--prompts 32] [--input-len 256]

Runs W1's shape (``--prompts`` random prompts of ``--input-len`` tokens, 8 greedy tokens out) on one
CUDA device in bfloat16 twice: once as the engine runs it, once with SDPA held to its flash and
memory-efficient kernels (``torch.nn.attention.sdpa_kernel``). Each pass prints the wall time of
each prefill step and of the median decode step, then the profiler's top ops by host (CPU) time and
by device time over the profiled steps. A warm-up pass of the same shapes runs first, so first-call
costs (module loading, cuBLAS handles) are not counted. Needs a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams


def run_pass(engine: LLMEngine, prompts: list[list[int]], tag: str, prof=None) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sampling)
    prefill, decode = [], []
    while engine.has_work():
        prefilling = bool(engine.scheduler.waiting) or not all(s.is_decoding for s in engine.scheduler.running)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        (prefill if prefilling else decode).append((time.perf_counter() - t) * 1e3)
        if prof is not None:
            prof.step()
    print(
        f"{tag}: prefill steps {', '.join(f'{x:.1f}' for x in prefill)} ms; "
        f"decode step median {statistics.median(decode):.2f} ms over {len(decode)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=12, help="ops printed per table")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", device="cuda", kv_cache_gib=2.0))
    rng = random.Random(0)
    vocab = engine.model_cfg.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  model {args.model}")
    run_pass(engine, prompts, "warm-up")
    restricted = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    for name, ctx in (("default SDPA", contextlib.nullcontext()), ("flash/efficient SDPA", restricted)):
        try:
            with ctx:
                run_pass(engine, prompts, f"{name}, warm")
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    run_pass(engine, prompts, f"{name}, profiled")
        except RuntimeError as e:  # e.g. no kernel of the restricted set takes these inputs
            print(f"{name}: {e}")
            for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                engine.abort(seq.request_id)
            continue
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
