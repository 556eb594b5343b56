"""Qwen3 and Qwen3-MoE: Llama's layer with RMSNorm over each head of q and k before RoPE (the
``qk_norm`` of ``ModelConfig``); in Qwen3-MoE the layers of ``cfg.moe_layers`` route each token to
``num_experts_per_tok`` experts (``mlp.gate`` the router, ``mlp.experts.{e}.*_proj`` the experts)."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights, gated_mlp, moe_block
from pdserve.engine.models.decoder import CausalLM, pre_norm_decoder, pre_norm_tensor_names

PROJ = ("gate_proj", "up_proj", "down_proj")


def _mlp_names(cfg: ModelConfig, i: int, p: str) -> list[str]:
    if i not in cfg.moe_layers:
        return [f"{p}mlp.{x}.weight" for x in PROJ]
    return [f"{p}mlp.gate.weight"] + [f"{p}mlp.experts.{e}.{x}.weight" for e in range(cfg.num_experts) for x in PROJ]


def tensor_names(cfg: ModelConfig) -> list[str]:
    return pre_norm_tensor_names(cfg, lambda i, p: _mlp_names(cfg, i, p))


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    def mlp(i: int, p: str):
        if i in cfg.moe_layers:
            experts = lambda e: [f"{p}mlp.experts.{e}.{x}" for x in PROJ]  # noqa: E731
            return moe_block(cfg, weights, f"{p}mlp.gate.weight", experts, ops)
        return gated_mlp(weights, *(f"{p}mlp.{x}" for x in PROJ), ops)

    return pre_norm_decoder(cfg, weights, attention, ops, mlp)
