"""A decoder-only causal LM over the paged KV cache: embedding, a stack of layers, final norm, lm_head.

The layers are the families' (``pdserve.engine.models.families``), made of the blocks in
``pdserve.engine.models.blocks``. The residual stream ``h`` is updated in place and each norm is fused
with the residual add before it (``ElementwiseOps.add_rms_norm``); a layer is called with ``h`` and
its normed input and returns the normed input of the next layer, so a layer of another shape (norms
after attention and MLP too, say) is a class of its own with the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.models.blocks import Attention, Weights, attention_block, attention_tensor_names
from pdserve.engine.models.decoder_stack import DecoderStack
from pdserve.engine.models.linear import make_linear
from pdserve.engine.models.ops import ElementwiseOps
from pdserve.engine.models.rope import rope_parameters


@dataclass
class PreNormLayer:
    """Llama's layer: ``h += attn(x)``, ``x = norm(h)``, ``h += mlp(x)``, ``x = next_norm(h)``.

    ``next_norm`` is the norm applied to this layer's output: the next layer's input norm, or the
    model's final norm after the last layer (the residual add is fused into it)."""

    attn: Attention
    post_norm: torch.Tensor
    mlp: Callable[[torch.Tensor], torch.Tensor]
    next_norm: torch.Tensor
    ops: ElementwiseOps
    eps: float

    def __call__(self, h, x, cos, sin, meta, cache) -> torch.Tensor:
        x = self.ops.add_rms_norm(h, self.attn(x, cos, sin, meta, cache), self.post_norm, self.eps)
        return self.ops.add_rms_norm(h, self.mlp(x), self.next_norm, self.eps)


class CausalLM:
    """Weights plus the forward pass. ``layers`` are callables as ``PreNormLayer``; ``first_norm`` is
    the first layer's input norm; ``attention`` the backend of the first layer (each sliding window
    has an instance of its own, all of one kind). The weights were fused and packed by the blocks;
    the Hugging Face tensors are not kept.

    ``layer_hook``: None, or called as ``layer_hook(i, layer_cache)`` on the forward's thread right
    after layer i ran, when ``layer_cache`` ([2, num_blocks, block_size, num_kv_heads, head_dim], the
    layer's part of the paged cache) holds this step's K and V of layer i (the prefill worker sends
    them from there while the next layers run). Unset, it costs one test per layer."""

    layer_hook: Callable[[int, torch.Tensor], None] | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        w: Weights,
        layers: list,
        first_norm: torch.Tensor,
        attention: AttentionBackend,
        ops: ElementwiseOps,
    ) -> None:
        self.cfg, self.layers, self.first_norm, self.attention, self.ops = cfg, layers, first_norm, attention, ops
        self.embed = w["model.embed_tokens.weight"]
        inv_freq, self.attention_scaling = rope_parameters(cfg)
        self.inv_freq = inv_freq.to(self.embed.device)
        self.lm_head = make_linear(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"], lm_head=True)
        self.stack = DecoderStack.build(self)  # the layer loop in one C++ call, where it applies

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # YaRN
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)  # [T, D] each

    def layer_metas(self, meta: AttentionMetadata | list[AttentionMetadata]) -> list[AttentionMetadata]:
        """One metadata per layer: ``meta`` itself when it is a list (a hybrid model's layers read
        their KV cache group's block tables), else ``meta`` for every layer."""
        return meta if isinstance(meta, list) else [meta] * len(self.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_cache: torch.Tensor | list[torch.Tensor],
    ) -> torch.Tensor:
        """Run the decoder.

        input_ids, positions: [num_tokens]. ``meta``: the step's attention metadata, or one per layer.
        kv_cache: each layer's part of the paged cache in layer order ([num_layers, 2, num_blocks,
        block_size, num_kv_heads, head_dim], or a list of [2, ...]), written in place at its
        metadata's ``slot_mapping``. Returns the final hidden states after the last norm,
        [num_tokens, hidden_size].
        """
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        cos, sin = self._rope(positions, h.dtype)
        x = self.ops.add_rms_norm(h, None, self.first_norm, self.cfg.rms_norm_eps)
        hook = self.layer_hook
        if self.stack is not None and self.stack.takes(cos, meta, kv_cache):
            self.stack(h, x, cos, sin, meta, kv_cache, hook)
            return x
        for i, (layer, cache, layer_meta) in enumerate(zip(self.layers, kv_cache, self.layer_metas(meta))):
            x = layer(h, x, cos, sin, layer_meta, cache)
            if hook is not None:
                hook(i, cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] logits."""
        return self.lm_head(hidden)


def pre_norm_decoder(
    cfg: ModelConfig,
    w: Weights,
    attention: Callable[[int], AttentionBackend],
    ops: ElementwiseOps,
    mlp: Callable[[int, str], Callable[[torch.Tensor], torch.Tensor]],
) -> CausalLM:
    """A stack of ``PreNormLayer`` under Llama's tensor names; ``mlp(i, prefix)`` builds layer i's MLP
    (``prefix``: ``model.layers.{i}.``)."""
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        nxt = w[f"model.layers.{i + 1}.input_layernorm.weight"] if i + 1 < cfg.num_layers else w["model.norm.weight"]
        attn = attention_block(cfg, w, p + "self_attn.", attention(i), ops)
        post = w[p + "post_attention_layernorm.weight"]
        layers.append(PreNormLayer(attn, post, mlp(i, p), nxt, ops, cfg.rms_norm_eps))
    return CausalLM(cfg, w, layers, w["model.layers.0.input_layernorm.weight"], attention(0), ops)


def pre_norm_tensor_names(cfg: ModelConfig, mlp: Callable[[int, str], list[str]]) -> list[str]:
    """Tensors ``pre_norm_decoder`` needs; ``mlp(i, prefix)`` names layer i's MLP tensors."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += attention_tensor_names(cfg, p + "self_attn.")
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", *mlp(i, p)]
    return names
