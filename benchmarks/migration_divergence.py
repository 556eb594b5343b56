"""Migration exactness by dtype: how often a migrated greedy stream leaves its undisturbed path.

A migrated (or preempted) request is prefilled again with its prompt plus the tokens already
streamed, then decodes on. Its continuation equals the undisturbed run exactly when the prefill
computes every position bit for bit as the decode steps did. For each prompt this script
generates ``--max-tokens`` greedy tokens undisturbed, then for each migration point k in
``--at`` prefills prompt + the first k tokens on a fresh engine and generates the rest; it
prints, per dtype, the share of (prompt, k) pairs whose continuation differs, the median number
of tokens until the first difference, and the largest gap between the logits the prefill and
the decode step computed for the first token after k (why: bfloat16 rounds each matmul's result,
and the kernels that serve a 1-row decode step and a many-row prefill sum in different orders).

    python benchmarks/migration_divergence.py                          # smollm2-135m, float32 and bfloat16
    python benchmarks/migration_divergence.py --model embedded:llama-80m --max-tokens 64
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "How can I improve my time management skills?",
    "Write a short poem about the sea.",
    "Explain what a KV cache is.",
    "The little dog ran to the park",
    "What is the capital of France? Tell me about its history.",
    "List three fruits and their colours.",
]


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def measure(model: str, dtype: str, max_tokens: int, points: list[int]) -> dict:
    from pdserve.engine.batch_invariance import logits_after
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    cfg = EngineConfig(model=model, dtype=dtype, num_kv_blocks=1024)
    engine = LLMEngine(cfg)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    undisturbed = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    pairs = diverged = 0
    until: list[int] = []
    for p, out in zip(prompts, undisturbed):
        for k in points:
            resumed = engine.generate(
                [p + out[:k]], SamplingParams(temperature=0.0, max_tokens=max_tokens - k, ignore_eos=True)
            )[0]
            pairs += 1
            first = next((i for i, (a, b) in enumerate(zip(resumed, out[k:])) if a != b), None)
            if first is not None:
                diverged += 1
                until.append(first)
    # the first token after k: decode step (undisturbed) vs a prefill of prompt + k tokens
    gaps: list[float] = []
    for p, out in zip(prompts, undisturbed):
        k = points[0]
        decoded = logits_after(engine, p, out[:k])
        gaps.append((decoded - logits_after(engine, p + out[:k], [])).abs().max().item())
    return {
        "dtype": engine.runner.dtype_name,
        "pairs": pairs,
        "diverged": diverged,
        "median_until": statistics.median(until) if until else None,
        "max_logit_gap": max(gaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--at", default="8,32,64", help="migration points, tokens already streamed")
    args = ap.parse_args()
    points = [int(x) for x in args.at.split(",")]
    print(
        f"CPU: {cpu_model()}; model {args.model}; {len(PROMPTS)} prompts x migration at {points}, "
        f"{args.max_tokens} greedy tokens"
    )
    print(
        "| dtype | (prompt, k) pairs | continuation differs | median tokens to the first difference "
        "| max logit gap, prefill vs decode |"
    )
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        r = measure(args.model, dtype, args.max_tokens, points)
        print(
            f"| {r['dtype']} | {r['pairs']} | {r['diverged']} ({r['diverged'] / r['pairs']:.0%}) | "
            f"{r['median_until'] if r['median_until'] is not None else '-'} | {r['max_logit_gap']:.3g} |"
        )


if __name__ == "__main__":
    main()
