"""``--lm-head-quantization``: lm_head's weight quantized on its own, the decoder layers' linears
with ``--quantization`` or not; the logits move by the weight's rounding only, the KV does not
(the fingerprint is unchanged), and the flag, config and throughput bound read it."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.cli.throughput import weight_bytes
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.quant import Int4Linear, Int8Linear
from pdserve.engine.params import SamplingParams
from pdserve.worker.flags import add_engine_args, engine_config_from_args


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", num_kv_blocks=64, torch_threads=1, **kw))


@pytest.mark.parametrize("scheme,cls", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_only_lm_head_is_quantized_and_only_the_logits_move(embedded_dir, scheme, cls):
    plain = _engine(embedded_dir)
    quant = _engine(embedded_dir, lm_head_quantization=scheme)
    model = quant.runner.model
    assert isinstance(model.lm_head, cls)
    assert not any(isinstance(v, (Int8Linear, Int4Linear)) for v in vars(model.layers[0].attn).values())
    assert quant.fingerprint == plain.fingerprint  # lm_head does not write the KV cache
    hidden = torch.randn(5, quant.model_cfg.hidden_size).bfloat16()
    ref = plain.runner.model.compute_logits(hidden).float()
    got = model.compute_logits(hidden).float()
    deq = hidden.float() @ model.lm_head.dequantized().T
    assert (got - ref).abs().max() > 0  # quantized
    assert (got - deq).abs().max() < 0.05 * ref.std()  # what its own weight computes, within rounding
    out = quant.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0]) == 8


def test_both_schemes_together(embedded_dir):
    engine = _engine(embedded_dir, quantization="int4", lm_head_quantization="int8")
    model = engine.runner.model
    assert isinstance(model.lm_head, Int8Linear)
    assert any(isinstance(v, Int4Linear) for v in vars(model.layers[0].mlp).values())


def test_config_flag_and_bound():
    with pytest.raises(ValueError, match="lm_head_quantization must be one of"):
        EngineConfig(model="embedded", lm_head_quantization="int3")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([]), "cpu").lm_head_quantization == "none"
    args = parser.parse_args(["--lm-head-quantization", "int8"])
    assert engine_config_from_args(args, "cpu").lm_head_quantization == "int8"


def test_the_throughput_bound_reads_lm_heads_quantized_bytes(embedded_dir):
    mc = ModelConfig.from_folder(embedded_dir)
    head = mc.hidden_size * mc.vocab_size
    assert weight_bytes(mc, 2, "int8") - weight_bytes(mc, 2, "int8", "int8") == head  # 2 bytes -> 1
