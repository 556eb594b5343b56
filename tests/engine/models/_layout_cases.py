"""The layouts of test_model_layouts.py: how each tiny checkpoint is built, its engine, the reference
outputs of ``transformers``, and the comparison of generated tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.models._tiny_models import BASE, STORIES, TOKENIZER_FILES, edit_config, hf_greedy, load_hf

NEEDS_TOKENIZER = pytest.mark.skipif(
    not all((STORIES / name).is_file() for name in TOKENIZER_FILES),
    reason=f"tokenizer folder {STORIES} is absent",
)

MAX_TOKENS = 20
PROMPT_LENS = (1, 11, 130)  # 130 > 64, the original context of the scaled-RoPE cases
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# YaRN with its defaults (beta_fast 32, beta_slow 1) and the attention factor from ``factor``
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def longrope(pairs: int, original: int, **extra) -> dict:
    """LongRoPE with ``pairs`` per-frequency factors in each set (rotary_dim // 2)."""
    short = [1.0 + 0.05 * i for i in range(pairs)]
    long = [1.0 + 1.5 * i for i in range(pairs)]
    return {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        **extra,
        "original_max_position_embeddings": original,
    }


# Checkpoints whose LongRoPE uses the long factors (max_position_embeddings 256 > the original 64):
# transformers uses them, as we do, once a sequence is longer than 64 tokens, so only prompts
# longer than that are compared (see engine/models/rope.py).
LONG_FACTORS = {"phi3_longrope": 64, "legacy_phi3_longrope": 64}


def _prompts(name: str = "") -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return [p for p in prompts if len(p) > LONG_FACTORS.get(name, 0)]


def _spec(name: str):
    """(model class, config, save_pretrained kwargs) of a named layout."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    three = {**BASE, "num_hidden_layers": 3}
    phi3 = {**BASE, "pad_token_id": 0}  # Phi3Config's default pad id 32000 is outside the tiny vocab

    specs = {
        # GQA with 4 query heads per KV head, untied lm_head, non-default rope_theta
        "llama_gqa": (
            LlamaForCausalLM,
            LlamaConfig(
                **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 2},
                rope_theta=50000.0,
                tie_word_embeddings=False,
            ),
            {},
        ),
        "llama_tied": (LlamaForCausalLM, LlamaConfig(**BASE, tie_word_embeddings=True), {}),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE, tie_word_embeddings=True, use_sliding_window=False), {}),
        # sharded on purpose: the loader must follow model.safetensors.index.json
        "mistral": (MistralForCausalLM, MistralConfig(**BASE, sliding_window=None), {"max_shard_size": "60KB"}),
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling=dict(LLAMA3)), {}),
        "linear_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
        # head_dim 32 while hidden / heads = 16
        "head_dim": (LlamaForCausalLM, LlamaConfig(**BASE, head_dim=32), {}),
        # q/k/v/o biases in a Llama
        "llama_attn_bias": (LlamaForCausalLM, LlamaConfig(**BASE, attention_bias=True), {}),
        # gate/up/down biases in a Llama
        "llama_mlp_bias": (LlamaForCausalLM, LlamaConfig(**BASE, mlp_bias=True), {}),
        "yarn_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling=dict(YARN)), {}),
        # q/k norm, head_dim 32 while hidden / heads = 16, tied embeddings
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True), {}),
        # a window of 16 in layers from max_window_layers = 1 on only (layer_types)
        "qwen3_window": (
            Qwen3ForCausalLM,
            Qwen3Config(**three, use_sliding_window=True, sliding_window=16, max_window_layers=1),
            {},
        ),
        # routed experts in layers 0 and 2 (layer 1 in mlp_only_layers), weights not renormalised
        "qwen3_moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **three, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]
            ),
            {},
        ),
        # experts in every second layer (decoder_sparse_step), top 3 of 8 renormalised
        "qwen3_moe_norm": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **three,
                num_experts=8,
                num_experts_per_tok=3,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                decoder_sparse_step=2,
            ),
            {},
        ),
        "mixtral": (MixtralForCausalLM, MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2), {}),
        # fused qkv_proj and gate_up_proj, no RoPE scaling, a window of 48 in every layer (Phi-3-mini-4k's 2047)
        "phi3": (Phi3ForCausalLM, Phi3Config(**phi3, sliding_window=48), {}),
        # LongRoPE's long factors and attention factor sqrt(1 + ln 4 / ln 64); RoPE on 12 of 16 dims
        "phi3_longrope": (
            Phi3ForCausalLM,
            Phi3Config(
                **phi3, original_max_position_embeddings=64, partial_rotary_factor=0.75, rope_scaling=longrope(6, 64)
            ),
            {},
        ),
        # original context = max_position_embeddings: the short factors at every length, attention factor 1
        "phi3_longrope_short": (
            Phi3ForCausalLM,
            Phi3Config(**phi3, original_max_position_embeddings=256, rope_scaling=longrope(8, 256)),
            {},
        ),
        # LongRoPE on a Llama: short factors (256 positions, none beyond the original), explicit factor 4
        "llama_longrope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling=longrope(8, 256, factor=4.0)), {}),
        # the scalings on other families than Llama
        "qwen2_yarn": (
            Qwen2ForCausalLM,
            Qwen2Config(**BASE, use_sliding_window=False, rope_scaling=dict(YARN)),
            {},
        ),
        "qwen3_linear": (
            Qwen3ForCausalLM,
            Qwen3Config(**BASE, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            {},
        ),
        "mistral_llama3": (
            MistralForCausalLM,
            MistralConfig(**BASE, sliding_window=None, rope_scaling=dict(LLAMA3)),
            {},
        ),
    }
    return specs[name]


LAYOUTS = [
    "llama_gqa",
    "llama_tied",
    "qwen2",
    "mistral",
    "llama3_rope",
    "linear_rope",
    "head_dim",
    "llama_attn_bias",
    "llama_mlp_bias",
    "yarn_rope",
    "qwen3",
    "qwen3_window",
    "qwen3_moe",
    "qwen3_moe_norm",
    "mixtral",
    "phi3",
    "phi3_longrope",
    "phi3_longrope_short",
    "llama_longrope",
    "qwen2_yarn",
    "qwen3_linear",
    "mistral_llama3",
]
# checkpoints rewritten into the transformers 4 config.json layout (rope_scaling + top-level rope_theta)
LEGACY = ["legacy_llama3_rope", "legacy_linear_rope", "legacy_yarn_rope", "legacy_phi3_longrope"]


def _to_legacy(folder: Path) -> None:
    """Move ``rope_parameters`` to the pre-v5 keys: ``rope_scaling`` and a top-level ``rope_theta``."""
    cfg = json.loads((folder / "config.json").read_text())
    params = dict(cfg["rope_parameters"])
    theta = params.pop("rope_theta")
    if params["rope_type"] == "linear":  # the oldest spelling: "type"
        params["type"] = params.pop("rope_type")
    elif params["rope_type"] == "longrope":  # the first Phi-3 checkpoints' name for it
        del params["rope_type"]
        params["type"] = "su"
    edit_config(folder, rope_parameters=None, rope_scaling=params, rope_theta=theta)


class Case:
    """A built checkpoint with its engine, its transformers model and the reference outputs."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name, self.folder = name, folder
        self.engine = make_engine(folder, block_size=16)
        self.hf = load_hf(folder)
        self.prompts = _prompts(name)
        self.ref = hf_greedy(self.hf, self.prompts, MAX_TOKENS, self.engine.eos_token_ids)


def make_engine(folder: Path, block_size: int) -> LLMEngine:
    num_blocks = -(-600 // block_size) + 8
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=num_blocks, block_size=block_size))


def _assert_same_tokens(ours: list[list[int]], ref: list[list[int]]) -> None:
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert r, "empty reference"
        assert o[: len(r)] == r, f"prompt {i}: ours {o} != transformers {r}"
        # the engine stops exactly where transformers does (EOS or max_tokens)
        assert len(o) == len(r), f"prompt {i}: {len(o)} tokens vs transformers {len(r)}"


def checkpoint_tensor_names(folder: Path) -> set[str]:
    """The tensor names a saved checkpoint's safetensors files hold."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    return names
