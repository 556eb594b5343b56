"""KV memory and hand-off bytes of a hybrid model (global + sliding-window layers) with KV cache groups.

Prefills one prompt of ``--prompt-tokens`` random tokens on a prefill engine, hands it to a decode
engine and decodes ``--decode-tokens`` more, then prints, measured from the engines' block tables
and the encoded frames:

* the KV bytes the decoding sequence holds (blocks held, all groups, times the bytes of a block),
  beside what it would hold if every layer kept every position (one table for all layers);
* the bytes of its layer-wise push (``layer_frames.stream_frames``, one round) beside the dense
  tensor a push of every position of every layer carries (the whole frame's tensor).

    python benchmarks/hybrid_kv.py --model gemma3-270m --prompt-tokens 4096
"""

from __future__ import annotations

import argparse
import time

from peers_env import machine_info

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.codec import frame_parts, pack_kv, unpack_kv
from pdserve.engine.kv.layer_frames import stream_frames
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import kv_bytes_per_block
from pdserve.engine.params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)

    cfg = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_gib=1.0, max_num_batched_tokens=8192)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    mc, groups = prefill.model_cfg, prefill.runner.kv_groups
    vocab = prefill.model_cfg.vocab_size
    prompt = [(7919 * i + 13) % (vocab - 10) + 5 for i in range(args.prompt_tokens)]
    sampling = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 2, ignore_eos=True)
    machine = machine_info()
    print(f"# {mc.architecture} ({args.model}), {args.dtype}; {machine['cpu']}, {machine['cores']} cores")
    print(
        f"# layers {mc.num_layers}, windows {sorted(set(mc.layer_windows), key=str)}, KV cache groups "
        f"{groups.num_groups} of {groups.group_size} layers, block {cfg.block_size} tokens"
    )

    start = time.perf_counter()
    prefill.add_request("r", prompt, sampling)
    payload = next(prefill.extract_kv(o.seq) for o in prefill.step() if o.prefill)
    prefill_s = time.perf_counter() - start
    seq = decode.admit_kv(unpack_kv(pack_kv(payload), decode.fingerprint))
    for _ in range(args.decode_tokens):
        decode.step()
    held = decode.blocks.num_held(seq)
    block_bytes = kv_bytes_per_block(mc, cfg.block_size, decode.runner.dtype)
    positions = seq.num_computed_tokens + 1
    every = -(-positions // cfg.block_size) * block_bytes * mc.num_layers // groups.group_size
    layered = sum(len(bytes(p)) for f in stream_frames(payload) for p in frame_parts(f))
    dense = payload.kv.numel() * payload.kv.element_size()
    mib = 1 / (1 << 20)
    print(f"prefill of {len(prompt)} tokens: {prefill_s:.2f} s")
    print(
        f"KV held by the sequence at {positions} positions: {held * block_bytes * mib:.2f} MiB with groups, "
        f"{every * mib:.2f} MiB keeping every position of every layer ({every / (held * block_bytes):.2f}x)"
    )
    print(
        f"layer-wise push: {layered * mib:.2f} MiB; dense tensor of every layer: {dense * mib:.2f} MiB "
        f"({dense / layered:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
