"""Llama, Mistral and Qwen2: pre-norm layers of grouped-query attention (q/k/v biases where the
checkpoint has them) and a SwiGLU MLP, under Llama's tensor names."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.blocks import Weights, gated_mlp
from pdserve.engine.models.decoder import CausalLM, pre_norm_decoder, pre_norm_tensor_names

MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tensor_names(cfg: ModelConfig) -> list[str]:
    return pre_norm_tensor_names(cfg, lambda i, p: [p + name + ".weight" for name in MLP])


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    return pre_norm_decoder(cfg, weights, attention, ops, lambda i, p: gated_mlp(weights, *(p + n for n in MLP), ops))
