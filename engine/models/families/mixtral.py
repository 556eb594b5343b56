"""Mixtral: Mistral's attention, and in every layer a router (``block_sparse_moe.gate``) sending each
token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (``w1`` gate, ``w3`` up, ``w2``
down), their weights renormalised to sum to 1."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights, moe_block, unstack_experts
from pdserve.engine.models.decoder import CausalLM, pre_norm_decoder, pre_norm_tensor_names

EXPERT = ("w1", "w3", "w2")  # gate, up, down


def _experts(moe: str):
    """Expert e's (gate, up, down) prefixes under ``moe`` (``model.layers.{i}.block_sparse_moe.``)."""
    return lambda e: [f"{moe}experts.{e}.{x}" for x in EXPERT]


def normalize(weights: Weights, cfg: ModelConfig) -> None:
    """transformers 5's layout in memory (``mlp.gate``, experts stacked into 3-D tensors under
    ``mlp.experts.``) becomes the checkpoints' (``block_sparse_moe.``, one tensor per expert)."""
    for i in range(cfg.num_layers):
        mlp, moe = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        if mlp + "gate.weight" in weights:
            weights[moe + "gate.weight"] = weights.pop(mlp + "gate.weight")
        unstack_experts(weights, mlp + "experts.", cfg.num_experts, _experts(moe))


def tensor_names(cfg: ModelConfig) -> list[str]:
    def mlp(i: int, p: str) -> list[str]:
        experts = _experts(p + "block_sparse_moe.")
        names = [f"{n}.weight" for e in range(cfg.num_experts) for n in experts(e)]
        return [p + "block_sparse_moe.gate.weight", *names]

    return pre_norm_tensor_names(cfg, mlp)


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    def mlp(i: int, p: str):
        moe = p + "block_sparse_moe."
        return moe_block(cfg, weights, moe + "gate.weight", _experts(moe), ops)

    return pre_norm_decoder(cfg, weights, attention, ops, mlp)
