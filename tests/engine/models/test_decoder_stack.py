"""The bfloat16 decoder stack in one C++ call (``engine/models/decoder_stack.py``) gives the layer
loop's bits: the same greedy tokens on a mixed batch (prefill chunks and decode rows) of the
embedded model, whose random weights leave many near-ties, so a single bit apart would show; and
it steps aside where it does not apply."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.decoder_stack import ENV
from pdserve.engine.models.kernels import KernelUnavailable, dense_linear, load_cpu_kernels
from pdserve.engine.params import SamplingParams


def _kernels_take_bf16() -> bool:
    try:
        load_cpu_kernels()
    except KernelUnavailable:
        return False
    return dense_linear(torch.zeros(32, 64, dtype=torch.bfloat16), None) is not None


needs_kernels = pytest.mark.skipif(not _kernels_take_bf16(), reason="no bf16 dense kernels on this CPU")


def _run(monkeypatch, flag: str, **cfg) -> tuple[list[list[int]], LLMEngine]:
    monkeypatch.setenv(ENV, flag)
    engine = LLMEngine(EngineConfig(model="embedded", dtype="bfloat16", num_kv_blocks=256, **cfg))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 40, 3, 120)]
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24)), engine


@needs_kernels
@pytest.mark.parametrize("chunk", [None, 32])  # whole prompts, or chunks beside decode rows
def test_the_stack_gives_the_layer_loops_tokens(monkeypatch, chunk):
    cfg = {"max_num_batched_tokens": chunk} if chunk else {}
    stacked, engine = _run(monkeypatch, "1", **cfg)
    assert engine.runner.model.stack is not None and engine.runner.model.stack.calls >= 24
    looped, other = _run(monkeypatch, "0", **cfg)
    assert other.runner.model.stack is None
    assert stacked == looped


@needs_kernels
@pytest.mark.parametrize("flag", ["1", "0"])
def test_a_layer_hook_sees_each_layers_kv_as_it_is_written(monkeypatch, flag):
    """A prefill worker's hook runs right after each layer of a prefill step, with that layer's KV
    already in the cache and the next layer's not yet: the same with the stack and with the loop."""
    monkeypatch.setenv(ENV, flag)
    engine = LLMEngine(EngineConfig(model="embedded", dtype="bfloat16", num_kv_blocks=64))
    caches, seen = engine.runner.layer_caches, []
    before = [c.view(torch.int16).clone() for c in caches]  # bits: an unwritten cache may hold NaNs

    def same(i: int) -> bool:
        return torch.equal(caches[i].view(torch.int16), before[i])

    def hook(batch, i, cache):
        seen.append((i, cache.data_ptr() == caches[i].data_ptr(), not same(i), i + 1 == len(caches) or same(i + 1)))

    engine.runner.layer_hook = hook
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2))
    assert seen == [(i, True, True, True) for i in range(len(caches))]
    assert engine.runner.model.stack is None or engine.runner.model.stack.calls == 2  # prefill and decode


@needs_kernels
def test_with_a_hook_the_stack_gives_the_loops_tokens(monkeypatch):
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV, flag)
        engine = LLMEngine(EngineConfig(model="embedded", dtype="bfloat16", num_kv_blocks=256))
        engine.runner.layer_hook = lambda batch, i, cache: None
        rng = random.Random(1)
        prompts = [[rng.randrange(1000) for _ in range(n)] for n in (7, 60, 33)]
        runs.append(engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12)))
    assert runs[0] == runs[1]


def test_float32_has_no_stack(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    engine = LLMEngine(EngineConfig(model="embedded", dtype="float32", num_kv_blocks=64))
    assert engine.runner.model.stack is None


def _vnni_kernels() -> bool:
    if not _kernels_take_bf16():
        return False
    return bool(load_cpu_kernels().pdserve_quant_linear_supported())


@pytest.mark.skipif(not _vnni_kernels(), reason="no AVX512-VNNI kernels on this CPU")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linears_run_in_the_stack_with_the_loops_tokens(monkeypatch, scheme):
    """int8 / int4 weights on the VNNI kernel join the stack; their kernel's rows do not depend on
    the batch around them, so the tokens are the loop's, chunked prefill beside decode rows too."""
    cfg = {"quantization": scheme, "lm_head_quantization": scheme, "max_num_batched_tokens": 32}
    stacked, engine = _run(monkeypatch, "1", **cfg)
    stack = engine.runner.model.stack
    assert stack is not None and stack.calls >= 24
    assert stack.max_rows == engine.runner.model.layers[0].attn.qkv.vnni_rows
    looped, other = _run(monkeypatch, "0", **cfg)
    assert other.runner.model.stack is None
    assert stacked == looped


@pytest.mark.skipif(not _vnni_kernels(), reason="no AVX512-VNNI kernels on this CPU")
def test_a_step_over_the_quantized_kernels_rows_takes_the_loop(monkeypatch):
    """Calls over ``vnni_rows`` rows dequantize the weight in Python, which the stack cannot: a step
    with more rows than ``max_rows`` runs the layer loop."""
    monkeypatch.setenv(ENV, "1")
    engine = LLMEngine(EngineConfig(model="embedded", dtype="bfloat16", num_kv_blocks=64, quantization="int8"))
    stack = engine.runner.model.stack
    stack.max_rows = 8
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=3))
    assert stack.calls == 2  # the two decode steps; the 12-row prefill ran the loop
