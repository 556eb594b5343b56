"""GPU check: the engine alone on one CUDA device, against transformers, then W1 and decode step times.

Run by ``benchmarks/gpu_check.sh`` (which installs the checkout with ``--no-deps``: the GPU machine
has torch, transformers, grpcio and msgpack but no Ray and no network). Needs no Ray, no gRPC.

1. float32 with TF32 off: greedy output of every prompt, batched, equals transformers' on the
   same device, token for token.
2. bfloat16: logits within the tolerance of ``tests/engine/models/test_bf16.py`` (0.1 std).
3. W1 in bfloat16 (32 x 256 -> 64) via ``run_throughput``, and the decode step time per batch size.
Exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pdserve.cli.throughput import format_result, median_decode_step_ms, run_throughput
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.engine.params import SamplingParams
from pdserve.engine.text.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "1, 2, 3, 5, 8,",
    "In a distant galaxy, a small robot",
    "今天天气很好，我们",
    "Hello" * 40,
]
LOGIT_TOL = 0.1
DEVICE = "cuda"  # --device cpu runs the same checks here, as a smoke test of this script


def hf_model(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(DEVICE).eval()


@torch.inference_mode()
def check_fp32(folder, max_tokens: int = 24) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = Tokenizer.from_folder(folder)
    prompts = [tok.encode(p) for p in PROMPTS]
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device=DEVICE, num_kv_blocks=512))
    ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    hf = hf_model(folder, torch.float32)
    ok = True
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device=DEVICE)
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            min_new_tokens=max_tokens,
        )[0, len(p) :].tolist()
        if o != ref:
            ok = False
            print(f"  MISMATCH prompt of {len(p)} tokens: ours {o} != transformers {ref}")
    print(
        f"fp32 greedy == transformers ({len(prompts)} prompts, {max_tokens} tokens, batched): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


@torch.inference_mode()
def check_bf16(folder) -> bool:
    from pdserve.engine.models.attention import AttentionMetadata

    tok = Tokenizer.from_folder(folder)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", device=DEVICE, num_kv_blocks=512))
    hf = hf_model(folder, torch.bfloat16)
    model, cache = engine.runner.model, engine.runner.kv_cache
    worst = 0.0
    for text in PROMPTS:
        p = tok.encode(text)
        ids = torch.tensor(p, device=DEVICE)
        pos = torch.arange(len(p), device=DEVICE)
        n, bs = len(p), engine.cfg.block_size
        table = torch.arange(-(-n // bs), dtype=torch.int32, device=DEVICE)[None]  # slots 0..n-1
        meta = AttentionMetadata(
            True,
            pos.clone(),
            table,
            torch.tensor([n], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            cu_seqlens=[0, n],
        )
        ours = model.compute_logits(model.forward(ids, pos, meta, cache)).float()
        ref = hf(ids[None]).logits[0].float()
        worst = max(worst, ((ours - ref).abs().max() / ref.std()).item())
        cache.zero_()
    ok = worst <= LOGIT_TOL
    print(f"bf16 logits within {LOGIT_TOL} std of transformers: worst {worst:.4f} {'PASS' if ok else 'FAIL'}")
    return ok


def decode_steps(model: str, batch_sizes: list[int], context: int = 256, steps: int = 20) -> None:
    engine = LLMEngine(
        EngineConfig(model=model, dtype="bfloat16", device=DEVICE, kv_cache_gib=2.0, max_num_seqs=max(batch_sizes))
    )
    vocab = engine.model_cfg.vocab_size
    for b in batch_sizes:
        prompts = [[(7 * i + j) % vocab for j in range(context)] for i in range(b)]
        step_ms = median_decode_step_ms(engine, prompts, steps)
        print(f"decode step bf16 batch {b:4d} context {context}: {step_ms:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device {name}  torch {torch.__version__}")
    ok = True
    for spec in ("embedded", args.model):
        folder = resolve_model_dir(spec)
        print(f"-- {spec}")
        ok &= check_fp32(folder)
        ok &= check_bf16(folder)
    res = run_throughput(EngineConfig(model=args.model, dtype="bfloat16", device=DEVICE, kv_cache_gib=2.0), 32, 256, 64)
    print(format_result(res))
    decode_steps(args.model, [int(b) for b in args.batch_sizes.split(",")])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
