"""Mixtral: Mistral's attention, and in every layer a router (``block_sparse_moe.gate``) sending each
token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (``w1`` gate, ``w3`` up, ``w2``
down), their weights renormalised to sum to 1."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights, moe_block
from pdserve.engine.models.decoder import CausalLM, pre_norm_decoder, pre_norm_tensor_names

EXPERT = ("w1", "w3", "w2")  # gate, up, down


def tensor_names(cfg: ModelConfig) -> list[str]:
    def mlp(i: int, p: str) -> list[str]:
        moe = p + "block_sparse_moe."
        return [moe + "gate.weight"] + [f"{moe}experts.{e}.{x}.weight" for e in range(cfg.num_experts) for x in EXPERT]

    return pre_norm_tensor_names(cfg, mlp)


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    def mlp(i: int, p: str):
        moe = p + "block_sparse_moe."
        return moe_block(cfg, weights, moe + "gate.weight", lambda e: [f"{moe}experts.{e}.{x}" for x in EXPERT], ops)

    return pre_norm_decoder(cfg, weights, attention, ops, mlp)
