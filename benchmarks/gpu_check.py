"""GPU check: the engine alone on one CUDA device, against transformers, then W1 and decode step times.

Run by ``benchmarks/gpu_check.sh`` (which installs the checkout with ``--no-deps``: the GPU machine
has torch, transformers, grpcio and msgpack but no Ray and no network). Needs no Ray, no gRPC.

1. float32 with TF32 off: greedy output of every prompt, batched, equals transformers' on the
   same device, token for token.
2. bfloat16: logits within the tolerance of ``tests/engine/models/test_bf16.py`` (0.1 std).
3. Split hand-off, float32: each prompt prefilled on one engine, its KV taken out (``extract_kv``)
   and placed on a second engine, once whole (``pack_kv`` / ``unpack_kv``) and once as a layer-wise
   stream (frames through ``KvStreamDecoder``, written with ``paged.write_layer``): the tokens equal
   transformers' and neither engine keeps a block.
4. int8 / int4 weights (bfloat16 activations): each quantized linear against its dequantized weight,
   and greedy agreement with bfloat16 (reported, not a pass/fail: quantization changes tokens).
5. W1 in bfloat16 (32 x 256 -> 64) via ``run_throughput``, and the decode step time per batch size
   for bfloat16, int8 and int4.
Exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from gpu_check_varlen import check_varlen

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
    ok, refs = True, []
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device=DEVICE)
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            min_new_tokens=max_tokens,
        )[0, len(p) :].tolist()
        refs.append(ref)
        if o != ref:
            ok = False
            print(f"  MISMATCH prompt of {len(p)} tokens: ours {o} != transformers {ref}")
    print(
        f"fp32 greedy == transformers ({len(prompts)} prompts, {max_tokens} tokens, batched): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok, prompts, refs


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


@torch.inference_mode()
def check_split(folder, prompts, refs, max_tokens: int = 24) -> bool:
    """Section 3: the hand-off between two CUDA engines, whole and layer-wise, against ``refs``."""
    from pdserve.engine.kv.codec import frame_parts, pack_kv, unpack_kv
    from pdserve.engine.kv.layer_frames import KvStreamEnd, KvStreamHead, LayerKv, stream_frames
    from pdserve.engine.kv.paged import read_layer, write_layer
    from pdserve.engine.kv.stream_decoder import KvStreamDecoder

    cfg = EngineConfig(model=str(folder), dtype="float32", device=DEVICE, num_kv_blocks=512)
    # no prefix cache on the prefill side: each prompt is computed whole, as the layer hook reads it
    prefill, decode = LLMEngine(replace(cfg, enable_prefix_caching=False)), LLMEngine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ok = True
    for mode in ("whole", "layer"):
        seqs = []
        for i, p in enumerate(prompts):
            layers: list[torch.Tensor] = []
            if mode == "layer":  # the prefill worker's hook: each layer read as soon as it is computed
                prefill.runner.layer_hook = lambda batch, li, cache, out=layers: out.append(
                    read_layer(cache, batch.seqs[0].block_table, 0, batch.num_query_tokens[0]).cpu()
                )
            prefill.add_request(f"{mode}-{i}", p, params)
            (out,) = prefill.step()
            prefill.runner.layer_hook = None
            payload = prefill.extract_kv(out.seq)
            if mode == "whole":
                seqs.append(decode.admit_kv(unpack_kv(pack_kv(payload), decode.fingerprint)))
                continue
            hooked = all(torch.equal(kv[:, : payload.kv.shape[2]], payload.kv[li]) for li, kv in enumerate(layers))
            ok &= hooked and len(layers) == payload.kv.shape[0]
            decoder, seq = KvStreamDecoder(decode.fingerprint), None
            for frame in stream_frames(payload):
                for event in decoder.add(b"".join(bytes(part) for part in frame_parts(frame))):
                    if isinstance(event, KvStreamHead):
                        seq = decode.reserve_kv(event)
                    elif isinstance(event, LayerKv):
                        write_layer(decode.runner.layer_caches[event.layer], seq.block_table, event.start, event.kv)
                    else:
                        assert isinstance(event, KvStreamEnd)
                        seqs.append(decode.admit_reserved(seq, event.first_token))
        while decode.has_work():
            decode.step()
        same = [s.output_token_ids for s in seqs] == refs
        leaks = prefill.blocks.num_used + decode.blocks.num_used
        ok &= same and leaks == 0
        verdict = "PASS" if same and not leaks and ok else "FAIL"
        print(f"fp32 split hand-off ({mode}) == transformers, 0 blocks left: {verdict}")
    return ok


@torch.inference_mode()
def check_graphs(folder, max_tokens: int = 24) -> bool:
    """Decode through captured CUDA graphs against the eager path: float32 must give the same
    tokens; bfloat16 agreement is reported (a GEMM over a padded batch may pick another kernel)."""
    tok = Tokenizer.from_folder(folder)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ok = True
    for dtype in ("float32", "bfloat16"):
        outs, replays = {}, 0
        for eager in (False, True):
            cfg = EngineConfig(model=str(folder), dtype=dtype, device=DEVICE, num_kv_blocks=512, enforce_eager=eager)
            engine = LLMEngine(cfg)
            outs[eager] = engine.generate(prompts, params)
            replays = replays if eager else (engine.runner.graphs.replays if engine.runner.graphs else 0)
        same = sum(a == b for a, b in zip(outs[False], outs[True]))
        print(f"{dtype} decode graphs ({replays} replayed steps) vs eager: {same}/{len(prompts)} prompts identical")
        if dtype == "float32":
            ok &= same == len(prompts) and (replays > 0 or DEVICE == "cpu")
    return ok


@torch.inference_mode()
def check_quantized(folder, max_tokens: int = 24) -> None:
    """Section 4: int8 / int4 linears against their dequantized weights, and greedy agreement."""
    from pdserve.engine.models.quant import Int4Linear, Int8Linear

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(1024, 768, device=DEVICE, generator=gen, dtype=torch.bfloat16) / 30
    x = torch.randn(8, 768, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    for lin in (Int8Linear(w, None), Int4Linear(w, None)):
        ref = x.float() @ lin.dequantized().float().T
        err = ((lin(x).float() - ref).abs().max() / ref.std()).item()
        print(f"{type(lin).__name__} on {DEVICE}: max error {err:.4f} std of the dequantized product")
    tok = Tokenizer.from_folder(folder)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for scheme in ("none", "int8", "int4"):
        cfg = EngineConfig(model=str(folder), dtype="bfloat16", device=DEVICE, num_kv_blocks=512, quantization=scheme)
        outs[scheme] = LLMEngine(cfg).generate(prompts, params)
    for scheme in ("int8", "int4"):
        same = sum(a == b for a, b in zip(outs[scheme], outs["none"]))
        tokens = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(outs[scheme], outs["none"]))
        print(
            f"{scheme} greedy vs bfloat16: {same}/{len(prompts)} prompts identical, "
            f"{tokens}/{len(prompts) * max_tokens} tokens at the same position"
        )


def decode_steps(
    model: str, batch_sizes: list[int], scheme: str, eager: bool, context: int = 256, steps: int = 20
) -> None:
    cfg = EngineConfig(
        enforce_eager=eager,
        model=model,
        dtype="bfloat16",
        device=DEVICE,
        kv_cache_gib=2.0,
        max_num_seqs=max(batch_sizes),
        quantization=scheme,
    )
    engine = LLMEngine(cfg)
    vocab = engine.model_cfg.vocab_size
    for b in batch_sizes:
        prompts = [[(7 * i + j) % vocab for j in range(context)] for i in range(b)]
        step_ms = median_decode_step_ms(engine, prompts, steps)
        how = "eager " if eager else "graphs"
        print(f"decode step bf16 {how} weights {scheme:4s} batch {b:4d} context {context}: {step_ms:.2f} ms")


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
    ok = check_varlen(DEVICE)
    for spec in ("embedded", args.model):
        folder = resolve_model_dir(spec)
        print(f"-- {spec}")
        fp32_ok, prompts, refs = check_fp32(folder)
        ok &= fp32_ok
        ok &= check_bf16(folder)
        ok &= check_split(folder, prompts, refs)
        ok &= check_graphs(folder)
        check_quantized(folder)
    res = run_throughput(EngineConfig(model=args.model, dtype="bfloat16", device=DEVICE, kv_cache_gib=2.0), 32, 256, 64)
    print(format_result(res))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for scheme, eager in (("none", True), ("none", False), ("int8", False), ("int4", False)):
        decode_steps(args.model, sizes, scheme, eager)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
