"""Tiny random Gemma 2 and Gemma 3 checkpoints (built by transformers itself, seeded, float32, with
the stories260K tokenizer), for test_gemma.py and tests/integration/test_model_families.py.

Each has 3 layers mixing sliding-window (16 positions) and global attention, so prompts of 23 tokens
and more exercise the window; a non-default ``query_pre_attn_scalar``; Gemma 2 soft-caps its
attention scores at 5 (the tiny random weights give scores beyond that) and its logits at 10.
"""

from __future__ import annotations

from pathlib import Path

from tests.engine.models._tiny_models import BASE, build_model, edit_config

THREE = {**BASE, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 24}
LOCAL_THETA = 1000.0
GLOBAL_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = ["gemma2", "gemma3", "gemma3_legacy", "gemma3_multimodal"]


def _text_config(name: str):
    from transformers import Gemma2Config, Gemma3TextConfig

    if name == "gemma2":  # layer_types from the even/odd rule: sliding, full, sliding
        return Gemma2Config(**THREE, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    rope = {
        "full_attention": dict(GLOBAL_ROPE),
        "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
    }
    return Gemma3TextConfig(**THREE, final_logit_softcapping=10.0, layer_types=TYPES, rope_parameters=rope)


def gemma_spec(name: str):
    """(model class, config, save_pretrained kwargs) of a named Gemma checkpoint."""
    from transformers import Gemma2ForCausalLM, Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    if name == "gemma2":
        return Gemma2ForCausalLM, _text_config(name), {}
    if name in ("gemma3", "gemma3_legacy"):
        return Gemma3ForCausalLM, _text_config(name), {}
    if name == "gemma3_multimodal":  # the text model inside Gemma3ForConditionalGeneration, beside a vision tower
        vision = {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        }
        text = _text_config("gemma3").to_dict()
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=511)
        return Gemma3ForConditionalGeneration, config, {}
    raise KeyError(name)


def build_gemma(folder: Path, name: str) -> Path:
    """Build checkpoint ``name`` in ``folder``; ``gemma3_legacy`` rewrites Gemma 3's config.json into
    transformers 4's keys (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern`` instead of ``layer_types``), which must read the same."""
    model_cls, config, kwargs = gemma_spec(name)
    build_model(folder, model_cls, config, **kwargs)
    if name == "gemma3_legacy":
        edit_config(
            folder,
            layer_types=None,
            _sliding_window_pattern=None,
            sliding_window_pattern=2,  # layers 0 and 2 sliding, 1 global: the same as TYPES
            rope_parameters=None,
            rope_theta=GLOBAL_ROPE["rope_theta"],
            rope_scaling={"rope_type": "linear", "factor": GLOBAL_ROPE["factor"]},
            rope_local_base_freq=LOCAL_THETA,
        )
    return folder
