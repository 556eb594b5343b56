"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Math follows the Hugging Face ``transformers`` Llama implementation so that greedy output is
token-identical to ``generate()`` in float32: RMSNorm in float32, rotate-half RoPE, grouped-query
attention, SwiGLU MLP. Attention is a backend (``pdserve.engine.models.attention``), and so are the
elementwise ops (``pdserve.engine.models.ops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.models.linear import Linear, fuse_rows, make_linear
from pdserve.engine.models.ops import ElementwiseOps


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (RoFormer, Su et al. 2021), with linear or Llama 3 scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: transformers' _compute_llama3_parameters (Llama 3.1 report, Meta 2024)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass
class DecoderLayer:
    """One layer's weights, fused and laid out for the device: q|k|v and gate|up are one GEMM each.

    ``next_norm`` is the norm applied to this layer's output: the next layer's input norm, or the
    model's final norm after the last layer (the residual add is fused into it)."""

    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    next_norm: torch.Tensor


class LlamaModel:
    """Weights plus the forward pass.

    ``weights`` uses the Hugging Face tensor names; they are fused and packed once here (see
    ``pdserve.engine.models.linear``) and the originals are not kept. ``attention`` and ``ops`` are the
    attention backend and elementwise ops chosen at start (``attention.select_backend``, ``ops.select_ops``).
    """

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], attention: AttentionBackend, ops: ElementwiseOps
    ) -> None:
        self.cfg = cfg
        self.attention = attention
        self.ops = ops
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.inv_freq = rope_inv_freq(cfg).to(self.embed.device)
        self.norm = w["model.norm.weight"]
        self.lm_head = make_linear(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_sizes = (q_rows, kv_rows, kv_rows)
            mlp_sizes = (cfg.intermediate_size, cfg.intermediate_size)
            self.layers.append(
                DecoderLayer(
                    qkv=make_linear(
                        fuse_rows(*(w[a + f"{x}_proj.weight"] for x in "qkv"), sizes=qkv_sizes),
                        fuse_rows(*(w.get(a + f"{x}_proj.bias") for x in "qkv"), sizes=qkv_sizes),
                    ),
                    o=make_linear(w[a + "o_proj.weight"], w.get(a + "o_proj.bias")),
                    post_norm=w[p + "post_attention_layernorm.weight"],
                    gate_up=make_linear(
                        fuse_rows(w[m + "gate_proj.weight"], w[m + "up_proj.weight"], sizes=mlp_sizes),
                        fuse_rows(w.get(m + "gate_proj.bias"), w.get(m + "up_proj.bias"), sizes=mlp_sizes),
                    ),
                    down=make_linear(w[m + "down_proj.weight"], w.get(m + "down_proj.bias")),
                    next_norm=w[f"model.layers.{i + 1}.input_layernorm.weight"]
                    if i + 1 < cfg.num_layers
                    else self.norm,
                )
            )
        self.first_norm = w["model.layers.0.input_layernorm.weight"]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)  # [T, D] each

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Run the decoder.

        input_ids, positions: [num_tokens]. kv_cache: [num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim], written in place at ``meta.slot_mapping``.
        Returns the final hidden states after the last norm, [num_tokens, hidden_size].
        """
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        cos, sin = self._rope(positions, h.dtype)
        x = ops.add_rms_norm(h, None, self.first_norm, eps)
        for layer, cache in zip(self.layers, kv_cache):
            x = ops.add_rms_norm(h, layer.o(self._attention(layer.qkv(x), cos, sin, meta, cache)), layer.post_norm, eps)
            x = ops.add_rms_norm(h, layer.down(ops.silu_mul(layer.gate_up(x))), layer.next_norm, eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] logits."""
        return self.lm_head(hidden)

    def _attention(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        """qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] -> [T, num_heads * head_dim].

        cache: this layer's [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        cfg = self.cfg
        T, H, Hkv, D = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        self.ops.rope_(qk, cos, sin)  # q and k at once, in place
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        flat = cache.view(2, -1, Hkv, D)  # [2, num_slots, Hkv, D]
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)
        if meta.is_prefill:
            return self.attention.prefill(q, k, v, cache[0], cache[1], meta)
        return self.attention.decode(q, cache[0], cache[1], meta)
