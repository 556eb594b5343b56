"""Weight-only quantization: batch-1 decode speed and accuracy of int8 and int4 beside bf16 (and fp32).

Every engine is built first, in this process, with one torch thread (``torch.set_num_threads(1)``);
then the TPOT rounds interleave them (round r times each engine once), so the ratios are measured
side by side on the same machine state. TPOT is the median wall time of one batch-1 decode step
(``LLMEngine.step``) over ``--tpot-tokens`` steps after a ``--prompt-len``-token prompt, the median of
that over ``--rounds`` rounds. Accuracy, against the bf16 engine: greedy agreement over ``--prompts``
prompts x ``--tokens`` tokens (the share of prompts whose whole continuation is identical, and the
mean share of tokens before the first divergence), and the max / mean absolute logit error of the
first step (the prefill's last position), with bf16's own error against fp32 beside it.

    python benchmarks/quant.py                                  # smollm2-135m
    python benchmarks/quant.py --model gemma3-270m --prompts 8
    python benchmarks/quant.py --lm-head                        # also: with --lm-head-quantization
    python benchmarks/quant.py --throughput                     # also: W1 through `pdserve throughput`

Every figure line carries the CPU's name (lscpu's "Model name") and whether it has AMX.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "Machine learning is a field of computer science that",
    "In 1969, the first humans to walk on the Moon were",
    "A healthy breakfast usually includes",
    "The difference between weather and climate is",
    "Photosynthesis is the process by which plants",
    "The best way to learn a new language is",
    "Python is a programming language that",
    "The human heart has four chambers:",
    "My favourite book is about a girl who",
    "The stock market fell sharply today because",
    "Gravity is the force that",
    "The recipe calls for two eggs, a cup of flour and",
    "Elephants are known for their",
    "The Great Wall of China was built to",
    "When the sun sets, the sky turns",
    "A good night's sleep helps the brain",
    "The internet was originally designed to",
    "Shakespeare wrote many plays, including",
]


def cpu() -> tuple[str, bool]:
    """(lscpu's model name, whether /proc/cpuinfo lists amx_tile)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    except OSError:
        name = "?"
    try:
        amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        amx = False
    return name, amx


def build(model: str, dtype: str, quantization: str, lm_head: str = "none"):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            lm_head_quantization=lm_head,
            num_kv_blocks=256,
            torch_threads=1,
            enable_prefix_caching=False,  # position_logits writes the cache outside the scheduler
        )
    )
    model_ = engine.runner.model
    first: list = []
    compute = model_.compute_logits

    def recording(hidden):  # keeps the logits of each step, for the first-step error
        logits = compute(hidden)
        first.append(logits[-1].float().clone())
        return logits

    model_.compute_logits = recording
    return engine, first


def generate(engine, first: list, ids: list[int], n: int) -> tuple[list[int], list[float], object]:
    """Greedy ``n`` tokens of ``ids`` alone: (tokens, decode step seconds, first-step logits [vocab])."""
    from pdserve.engine.params import SamplingParams

    first.clear()
    seq = engine.add_request(
        f"q{time.perf_counter_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    steps = []
    while engine.has_work():
        t = time.perf_counter()
        out = engine.step()
        if out and not out[0].prefill:
            steps.append(time.perf_counter() - t)
    return list(seq.output_token_ids), steps, first[0]


def position_logits(engine, ids: list[int]):
    """Logits [len(ids), vocab] (float32) of one prefill of ``ids`` straight through the model, in
    the first KV blocks (the engine must hold no sequence)."""
    import torch

    from pdserve.engine.models.attention import AttentionMetadata

    runner, n = engine.runner, len(ids)
    blocks = list(range(-(-n // engine.cfg.block_size)))
    pos = torch.arange(n)
    meta = AttentionMetadata(
        True,
        pos.clone(),
        torch.tensor([blocks], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.tensor([0, n], dtype=torch.int32),
        cu_seqlens=[0, n],
    )
    hidden = runner.model.forward(torch.tensor(ids), pos, meta, runner.kv_cache)
    return type(runner.model).compute_logits(runner.model, hidden).float()


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of prompts identical throughout, mean share of tokens before the first divergence)."""
    same, prefix = 0, []
    for a, b in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        same += k == len(a)
        prefix.append(k / len(a))
    return same / len(ref), statistics.mean(prefix)


def accuracy(args, engines: dict, tok, figures: dict, tag: str) -> None:
    """Greedy agreement with bf16 (free-running: whole continuations; teacher-forced: the top-1 token
    at each position of bf16's continuation) and the logit error, first step and every position."""
    prompts = [tok.encode(text) for text in PROMPTS[: args.prompts]]
    outs: dict[str, list[list[int]]] = {label: [] for label in engines}
    first: dict[str, list] = {label: [] for label in engines}
    for ids in prompts:
        for label, (engine, record) in engines.items():
            out, _, lg = generate(engine, record, ids, args.tokens)
            outs[label].append(out)
            first[label].append(lg)
    full = {label: [] for label in engines}  # logits over bf16's continuation, [tokens, vocab] per prompt
    for ids, ref in zip(prompts, outs["bf16"]):
        for label, (engine, _) in engines.items():
            full[label].append(position_logits(engine, ids + ref)[len(ids) - 1 : -1])
    print(f"accuracy against bf16: {len(prompts)} prompts x {args.tokens} greedy tokens {tag}")
    for label in engines:
        if label == "bf16":
            continue
        same, prefix = agreement(outs["bf16"], outs[label])
        forced = statistics.mean(
            (a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(full[label], full["bf16"])
        )
        errors = [(a - b).abs() for a, b in zip(first[label], first["bf16"])]
        mx, mean = max(e.max().item() for e in errors), statistics.mean(e.mean().item() for e in errors)
        every = max((a - b).abs().max().item() for a, b in zip(full[label], full["bf16"]))
        figures["schemes"][label].update(
            identical=same,
            prefix=prefix,
            teacher_forced=forced,
            logit_max_err=mx,
            logit_mean_err=mean,
            logit_max_err_all_positions=every,
        )
        print(
            f"  {label:13s} identical {same:6.1%}  before divergence {prefix:6.1%}  teacher-forced top-1 "
            f"{forced:6.1%}  first-step logits |err| max {mx:.3f} mean {mean:.4f}  {tag}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16, help=f"accuracy prompts (at most {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per accuracy prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of the TPOT prompt")
    p.add_argument("--tpot-tokens", type=int, default=64, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-fp32", action="store_true", help="leave out the fp32 engine")
    p.add_argument("--tpot-only", action="store_true", help="no accuracy figures")
    p.add_argument("--lm-head", action="store_true", help="also int8 / int4 with lm_head quantized (int8 or int4)")
    p.add_argument("--throughput", action="store_true", help="also W1 (`pdserve throughput`) per scheme")
    p.add_argument("--throughput-threads", type=int, default=2, help="torch threads of the W1 runs")
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--weight-error", nargs="+", metavar="GGUF", help="only the weight error of these models")
    args = p.parse_args()
    if args.weight_error:
        from quant_weights import weight_error

        weight_error(args.weight_error)
        return

    import torch

    torch.set_num_threads(1)
    name, amx = cpu()
    tag = f"[{name}, AMX {'yes' if amx else 'no'}, 1 thread]"
    configs = [("bf16", "bfloat16", "none", "none"), ("int8", "bfloat16", "int8", "none")]
    configs.append(("int4", "bfloat16", "int4", "none"))
    if args.lm_head:
        configs.append(("int8+head8", "bfloat16", "int8", "int8"))
        configs += [("int4+head8", "bfloat16", "int4", "int8"), ("int4+head4", "bfloat16", "int4", "int4")]
    if not args.no_fp32:
        configs.append(("fp32", "float32", "none", "none"))
    engines = {label: build(args.model, dtype, q, head) for label, dtype, q, head in configs}
    tok = engines["bf16"][0].tokenizer

    # TPOT, rounds interleaved across the engines
    gen = torch.Generator().manual_seed(0)
    vocab = engines["bf16"][0].model_cfg.vocab_size
    tpot: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(args.rounds):
        ids = torch.randint(100, min(vocab, 30000), (args.prompt_len,), generator=gen).tolist()
        for label, (engine, first) in engines.items():
            _, steps, _ = generate(engine, first, ids, args.tpot_tokens + 1)
            tpot[label].append(statistics.median(steps))
    figures: dict = {"cpu": name, "amx": amx, "model": args.model, "threads": 1, "schemes": {}}
    base = statistics.median(tpot["bf16"])
    print(f"batch-1 decode TPOT, {args.model}, {args.prompt_len}-token prompt, median of {args.rounds} rounds {tag}")
    for label, values in tpot.items():
        ms = statistics.median(values) * 1e3
        figures["schemes"][label] = {
            "tpot_ms": ms,
            "speedup_vs_bf16": base * 1e3 / ms,
            "rounds_ms": [v * 1e3 for v in values],
        }
        spread = f"rounds {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
        print(f"  {label:13s} TPOT {ms:7.2f} ms  {base * 1e3 / ms:5.2f}x bf16  {spread}  {tag}")

    if not args.tpot_only:
        accuracy(args, engines, tok, figures, tag)

    if args.throughput:
        figures["throughput"] = {}
        w1_tag = f"[{name}, AMX {'yes' if amx else 'no'}, {args.throughput_threads} threads]"
        print(f"W1 offline throughput (32 x 256 -> 64), bfloat16 {w1_tag}")
        for q in ("none", "int8", "int4"):
            out = Path(tempfile.mkdtemp()) / "w1.json"
            cmd = [sys.executable, "-m", "pdserve.cli.main", "throughput", "--model", args.model, "--dtype", "bfloat16"]
            cmd += ["--quantization", q, "--threads", str(args.throughput_threads), "--json", str(out)]
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = json.loads(out.read_text())
            figures["throughput"][q] = row
            print(
                f"  {q:5s} total {row['total_tokens_per_s']:8.1f} tok/s  output {row['output_tokens_per_s']:7.1f} "
                f"tok/s  decode step {row['decode_step_ms']:6.1f} ms at batch {row['decode_batch']}  {w1_tag}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
