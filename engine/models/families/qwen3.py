"""Qwen3 and Qwen3-MoE: Llama's layer with RMSNorm over each head of q and k before RoPE (the
``qk_norm`` of ``ModelConfig``); in Qwen3-MoE the layers of ``cfg.moe_layers`` route each token to
``num_experts_per_tok`` experts (``mlp.gate`` the router, ``mlp.experts.{e}.*_proj`` the experts)."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights, gated_mlp, moe_block, unstack_experts
from pdserve.engine.models.decoder import CausalLM, pre_norm_decoder, pre_norm_tensor_names

PROJ = ("gate_proj", "up_proj", "down_proj")


def _experts(mlp: str):
    """Expert e's (gate, up, down) prefixes under ``mlp`` (``model.layers.{i}.mlp.``)."""
    return lambda e: [f"{mlp}experts.{e}.{x}" for x in PROJ]


def normalize(weights: Weights, cfg: ModelConfig) -> None:
    """Experts stacked into 3-D tensors (transformers 5's layout in memory) become one per expert."""
    for i in cfg.moe_layers:
        mlp = f"model.layers.{i}.mlp."
        unstack_experts(weights, mlp + "experts.", cfg.num_experts, _experts(mlp))


def tensor_names(cfg: ModelConfig) -> list[str]:
    def mlp(i: int, p: str) -> list[str]:
        if i not in cfg.moe_layers:
            return [f"{p}mlp.{x}.weight" for x in PROJ]
        experts = _experts(p + "mlp.")
        return [p + "mlp.gate.weight"] + [f"{n}.weight" for e in range(cfg.num_experts) for n in experts(e)]

    return pre_norm_tensor_names(cfg, mlp)


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    def mlp(i: int, p: str):
        if i in cfg.moe_layers:
            return moe_block(cfg, weights, p + "mlp.gate.weight", _experts(p + "mlp."), ops)
        return gated_mlp(weights, *(f"{p}mlp.{x}" for x in PROJ), ops)

    return pre_norm_decoder(cfg, weights, attention, ops, mlp)
