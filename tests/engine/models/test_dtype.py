"""``--dtype auto``: the checkpoint's dtype, float32 -> bfloat16 where matmul has native bf16."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models import dtype as dtype_mod
from pdserve.engine.models.dtype import native_bf16, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "feature, checkpoint, want",
    [
        ("avx512_bf16", "float32", "bfloat16"),
        (None, "float32", "float32"),
        ("amx_bf16", "bfloat16", "bfloat16"),
        (None, "bfloat16", "bfloat16"),
        ("avx512_bf16", "float16", "bfloat16"),
        (None, "float16", "float32"),
    ],
)
def test_auto_rule(monkeypatch, feature, checkpoint, want):
    monkeypatch.setattr(dtype_mod, "native_bf16", lambda device: feature)
    name, why = resolve_dtype("auto", checkpoint, CPU)
    assert name == want
    assert checkpoint in why  # the log line says why


def test_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(dtype_mod, "native_bf16", lambda device: "avx512_bf16")
    assert resolve_dtype("float32", "float32", CPU) == ("float32", "as asked by --dtype")


def test_checkpoint_dtype_is_read_from_config():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert ModelConfig.from_dict(base).torch_dtype == "float32"
    assert ModelConfig.from_dict({**base, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert ModelConfig.from_dict({**base, "dtype": "float16", "torch_dtype": "float32"}).torch_dtype == "float16"
    assert ModelConfig.from_dict({**base, "torch_dtype": "float64"}).torch_dtype == "float32"


def test_engine_auto_runs_what_the_rule_says(embedded_dir):
    engine = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=16))
    want = "bfloat16" if native_bf16(CPU) else "float32"  # the embedded checkpoint is float32
    assert engine.cfg.dtype == "auto"
    assert engine.runner.dtype_name == want
    assert engine.runner.kv_cache.dtype == getattr(torch, want)
    assert engine.fingerprint.dtype == want


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        EngineConfig(model="embedded", dtype="int8")
