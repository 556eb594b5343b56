"""Checkpoints our Llama-family forward cannot run are refused when the engine loads them, with the reason:
another architecture, missing weight files or tensors, unsupported RoPE scaling or activation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.engine.models._layout_cases import NEEDS_TOKENIZER
from tests.engine.models._tiny_models import drop_tensor, edit_config

pytestmark = [NEEDS_TOKENIZER, pytest.mark.usefixtures("_one_thread")]  # _one_thread: see conftest.py

transformers = pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402


def _copy(cases, tmp_path: Path, name: str = "llama_gqa") -> Path:
    dst = tmp_path / "model"
    shutil.copytree(cases(name).folder, dst)
    return dst


def test_unsupported_architecture(cases, tmp_path):
    folder = _copy(cases, tmp_path)
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))
    supported = str(info.value).split("supported: ")[1].split(", ")
    assert {
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
    } <= set(supported)


def test_missing_safetensors(cases, tmp_path):
    folder = _copy(cases, tmp_path)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("llama_gqa", "model.layers.1.mlp.down_proj.weight"),
        ("llama_gqa", "lm_head.weight"),
        ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ],
)
def test_missing_tensor(cases, tmp_path, name, tensor):
    folder = _copy(cases, tmp_path, name)
    drop_tensor(folder, tensor)
    with pytest.raises(KeyError, match=tensor.replace(".", r"\.")):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


@pytest.mark.parametrize(
    "changes, kind",
    [
        ({"rope_parameters": {"rope_type": "made-up", "factor": 2.0, "rope_theta": 1e4}}, "'made-up'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        # Phi-3's older name of LongRoPE is not one for a Llama (as in transformers)
        ({"rope_parameters": {"rope_type": "su", "short_factor": [1.0] * 8, "rope_theta": 1e4}}, "'su'"),
    ],
)
def test_unsupported_rope_type(cases, tmp_path, changes, kind):
    folder = _copy(cases, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=f"unsupported rope scaling {kind}.*; supported: default, linear, llama3"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


def test_longrope_factors_of_the_wrong_length(cases, tmp_path):
    """One factor per pair of rotary dims (rotary_dim // 2), else refused naming both counts."""
    folder = _copy(cases, tmp_path, "phi3_longrope")  # 12 rotary dims: 6 factors
    edit_config(
        folder,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75,
            "rope_theta": 1e4,
        },
    )
    with pytest.raises(ValueError, match="longrope factors have 8 entries; the rotary dims need 6"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


def test_unsupported_activation(cases, tmp_path):
    """A Llama config with another activation than SiLU must be refused, not run as SiLU."""
    folder = _copy(cases, tmp_path)
    edit_config(folder, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))
