"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's layer under fused tensor names, ``self_attn.qkv_proj``
(q | k | v rows) and ``mlp.gate_up_proj`` (gate | up rows); RoPE with LongRoPE scaling and a
``partial_rotary_factor`` (``pdserve.engine.models.rope``), a sliding window in every layer when
config.json sets one."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.families import llama


def normalize(weights: Weights, cfg: ModelConfig) -> None:
    """The fused checkpoint tensors become Llama's names, as views of their rows (the blocks fuse
    them back into one GEMM each); a checkpoint already split is left as it is."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = weights.pop(attn + "qkv_proj.weight", None)
        if qkv is not None:
            parts = qkv.split((q, kv, kv), dim=0)
            weights.update({f"{attn}{x}_proj.weight": t for x, t in zip("qkv", parts, strict=True)})
        gate_up = weights.pop(mlp + "gate_up_proj.weight", None)
        if gate_up is not None:
            weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"] = gate_up.chunk(2, dim=0)


def tensor_names(cfg: ModelConfig) -> list[str]:
    return llama.tensor_names(cfg)


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    return llama.build(cfg, weights, attention, ops)
