"""The model families pdserve runs, keyed on config.json's ``architectures[0]``.

Each architecture names a :class:`Family`: the module under ``pdserve.engine.models.families`` that
builds its forward pass, plus the few facts ``ModelConfig.from_dict`` needs to read its config.json
the way ``transformers`` does. This module imports no torch, so that the router and the cluster
launcher can refuse an unknown architecture (``family``) before any worker starts.

A family module defines:

* ``tensor_names(cfg) -> list[str]``: the Hugging Face tensor names its forward pass needs (the
  loader refuses a checkpoint that lacks one, naming it);
* ``build(cfg, weights, attention, ops) -> CausalLM`` (``pdserve.engine.models.decoder``): the model,
  where ``attention(layer)`` is that layer's attention backend;
* optionally ``normalize(weights, cfg)``: rewrite tensors of another checkpoint layout (fused q|k|v,
  3-D expert stacks) into the names ``tensor_names`` lists, in place, before they are checked;
* optionally ``checkpoint_name(key) -> str | None``: the name a checkpoint's tensor loads under, or
  None to leave it unloaded (Gemma 3's vision tower); by default ``model.*`` and ``lm_head.weight``.

Adding a family: write the module over the blocks in ``pdserve.engine.models.blocks``, add its
architectures here, and any config.json fields it reads to ``ModelConfig``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    """How one architecture's config.json is read, and which module builds it.

    ``qkv_bias``: the q/k/v projections have biases when config.json sets no ``attention_bias``
    (Qwen2). ``qk_norm``: RMSNorm over each head of q and k before RoPE (Qwen3). ``window_flag``:
    ``sliding_window`` counts only with ``use_sliding_window`` (Qwen). ``layer_types``: the window
    applies to the layers config.json's ``layer_types`` marks ``sliding_attention``, or without
    them to layers from ``max_window_layers`` on; otherwise to every layer. ``norm_topk_prob``: the
    routed experts' weights are renormalised to sum to 1 (None: as config.json's ``norm_topk_prob``).
    ``gemma``: Gemma's generation (2 or 3), whose own config.json fields
    ``pdserve.engine.models.gemma_config`` reads.
    ``longrope_aliases``: RoPE scaling types this family reads as ``longrope`` (Phi-3's older "su"
    and "yarn", as transformers' ``Phi3Config`` does).
    """

    module: str
    qkv_bias: bool = False
    qk_norm: bool = False
    window_flag: bool = False
    layer_types: bool = False
    norm_topk_prob: bool | None = None
    longrope_aliases: tuple[str, ...] = ()
    gemma: int = 0


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("llama"),
    "Qwen2ForCausalLM": Family("llama", qkv_bias=True, window_flag=True, layer_types=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True, window_flag=True, layer_types=True),
    "Qwen3MoeForCausalLM": Family("qwen3", qk_norm=True, window_flag=True),
    "MixtralForCausalLM": Family("mixtral", norm_topk_prob=True),
    "Phi3ForCausalLM": Family("phi3", longrope_aliases=("su", "yarn")),
    "Gemma2ForCausalLM": Family("gemma", layer_types=True, gemma=2),
    "Gemma3ForCausalLM": Family("gemma", qk_norm=True, layer_types=True, gemma=3),
    "Gemma3ForConditionalGeneration": Family("gemma", qk_norm=True, layer_types=True, gemma=3),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# config.json's ``model_type`` -> the architecture transformers' AutoModelForCausalLM builds for it,
# for a config.json that names no ``architectures``
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def architecture_of(raw: dict) -> str:
    """``architectures[0]`` of a parsed config.json, or without it the architecture of its
    ``model_type``; ValueError when it has neither, or ``architectures`` is not a list."""
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list):
            raise ValueError(f"config.json: 'architectures' must be a list of names, got {archs!r}")
        return archs[0]
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    known = ", ".join(MODEL_TYPES)
    what = "no model_type" if model_type is None else f"a model_type, {model_type!r}, not one of {known}"
    raise ValueError(
        f"config.json names no 'architectures' and {what}; "
        f'add "architectures": [one of {", ".join(SUPPORTED_ARCHITECTURES)}]'
    )


def family(architecture: str) -> Family:
    """The family of ``architecture``; ValueError naming the supported ones for any other."""
    found = ARCHITECTURES.get(architecture)
    if found is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return found


def family_module(architecture: str) -> ModuleType:
    """The module that builds ``architecture`` (imports torch)."""
    return importlib.import_module(f"pdserve.engine.models.families.{family(architecture).module}")
