"""Long plus short: how much one long sequence in the decode batch slows the short ones' TPOT.

Eight 16-token prompts decode alone, then again beside one 1,500-token prompt (lengths are flags).
A decode step costs the weights plus the KV it reads; with paged attention that KV is the sum of
the context lengths, so the long sequence should add its own KV read, not batch x longest.
Prints the median decode step (= TPOT of every sequence in the batch) both ways and the ratio.
Run: ``python benchmarks/long_short.py [--model M] [--dtype D] [--threads N]``.
"""

from __future__ import annotations

import argparse
import random

from pdserve.cli.throughput import median_decode_step_ms
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--short", type=int, default=8, help="number of short prompts")
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            torch_threads=args.threads,
            attention_backend=args.attention_backend,
            kv_cache_gib=1.0,
        )
    )
    rng = random.Random(0)
    vocab = engine.model_cfg.vocab_size
    shorts = [[rng.randrange(vocab) for _ in range(args.short_len)] for _ in range(args.short)]
    long_prompt = [rng.randrange(vocab) for _ in range(args.long_len)]
    median_decode_step_ms(engine, shorts[:2], 3)  # warm-up
    alone = median_decode_step_ms(engine, shorts, args.steps)
    beside = median_decode_step_ms(engine, shorts + [long_prompt], args.steps)
    print(f"model {args.model}  dtype {engine.runner.dtype_name}  attention {engine.runner.model.attention.name}")
    print(f"{args.short} x {args.short_len}-token prompts alone:          TPOT {alone:6.2f} ms")
    print(
        f"the same beside one {args.long_len}-token prompt: TPOT {beside:6.2f} ms  "
        f"({beside / alone:.2f}x alone; target <= 1.3x)"
    )


if __name__ == "__main__":
    main()
