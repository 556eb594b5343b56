"""Batch invariance of the CPU paged attention kernel: a position's logits are the same bits
whether decode steps computed the sequence one token at a time or one prefill computed it whole,
so a migrated or preempted sequence (recomputed by prefill) continues exactly, in bfloat16 too."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.batch_invariance import logits_after
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels
from pdserve.engine.params import SamplingParams

STORY = "The little dog ran to the park and played with a red ball until the sun went down. "


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_and_decode_compute_a_position_the_same_bits(embedded_dir, dtype):
    try:
        load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"the C++ kernel cannot be built here: {exc}")
    engine = LLMEngine(
        EngineConfig(
            model=str(embedded_dir),
            dtype=dtype,
            num_kv_blocks=512,
            block_size=16,
            attention_backend="cpu-paged",
            enable_prefix_caching=False,
        )
    )
    prompt = engine.tokenizer.encode(STORY)
    out = engine.generate([prompt], greedy(40))[0]
    for k in (7, 20, 33):  # migration points inside and across KV blocks
        by_decode = logits_after(engine, prompt, out[:k])
        by_prefill = logits_after(engine, prompt + out[:k], [])
        assert torch.equal(by_decode, by_prefill), (k, (by_decode.float() - by_prefill.float()).abs().max())
        assert engine.generate([prompt + out[:k]], greedy(40 - k))[0] == out[k:]
