"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Math follows the Hugging Face ``transformers`` Llama implementation so that greedy output is
token-identical to ``generate()`` in float32: RMSNorm in float32, rotate-half RoPE, grouped-query
attention via repeated KV heads, SwiGLU MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (all int64 on the model's device).

    slot_mapping: [num_tokens] KV cache slot written by each input token.
    Prefill: ``cu_seqlens`` [num_seqs + 1] offsets of each sequence in the packed input; every
    sequence starts at position 0, so attention reads the fresh K/V, not the cache.
    Decode: ``block_tables`` [num_seqs, max_blocks] (padded with 0) and ``context_lens`` [num_seqs],
    the number of KV positions to attend to, the new token included.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in float32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights plus the forward pass. ``weights`` uses the Hugging Face tensor names."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.lm_head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.scale = cfg.head_dim ** -0.5

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                       # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the decoder.

        input_ids, positions: [num_tokens]. kv_cache: [num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim], written in place at ``meta.slot_mapping``.
        Returns the final hidden states after the last norm, [num_tokens, hidden_size].
        """
        cfg, w = self.cfg, self.w
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        cos, sin = self._rope(positions, h.dtype)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            h = h + self._attention(x, p + "self_attn.", cos, sin, meta, kv_cache[i])
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = F.linear(x, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"))
            up = F.linear(x, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"))
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"))
        return rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] logits."""
        return F.linear(hidden, self.lm_head)

    def _prefill_mask(self, n: int, device) -> torch.Tensor | None:
        """None (plain causal) unless a sliding window is shorter than ``n``; then a bool [n, n] mask
        where query i sees key j iff j <= i and i - j < window (transformers' sliding-window rule)."""
        window = self.cfg.sliding_window
        if window is None or n <= window:
            return None
        i = torch.arange(n, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        return (j <= i) & (i - j < window)

    def _attention(self, x, p, cos, sin, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        T = x.shape[0]
        q = F.linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(T, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(T, cfg.num_kv_heads, cfg.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # cache: [2, num_blocks, block_size, kv_heads, head_dim]; write K/V at their slots
        flat = cache.view(2, -1, cfg.num_kv_heads, cfg.head_dim)
        flat[0].index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(cache.dtype))
        groups = cfg.num_heads // cfg.num_kv_heads
        if meta.is_prefill:
            out = torch.empty_like(q)
            bounds = meta.cu_seqlens
            for s in range(len(bounds) - 1):
                a, b = bounds[s], bounds[s + 1]
                # 4-D [1, H, n, D]: SDPA's fused CPU kernel; 3-D inputs take a ~10x slower path
                qs = q[a:b].transpose(0, 1)[None]
                ks = k[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
                vs = v[a:b].transpose(0, 1).repeat_interleave(groups, dim=0)[None]
                mask = self._prefill_mask(b - a, q.device)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                   scale=self.scale)
                out[a:b] = o[0].transpose(0, 1)
        else:
            keys = cache[0][meta.block_tables].flatten(1, 2).to(q.dtype)   # [B, L, kv_heads, D]
            vals = cache[1][meta.block_tables].flatten(1, 2).to(q.dtype)
            keys = keys.transpose(1, 2).repeat_interleave(groups, dim=1)    # [B, H, L, D]
            vals = vals.transpose(1, 2).repeat_interleave(groups, dim=1)
            L = keys.shape[2]
            pos = torch.arange(L, device=q.device)[None, :]
            mask = pos < meta.context_lens[:, None]  # [B, L]
            if cfg.sliding_window is not None:
                mask &= pos >= meta.context_lens[:, None] - cfg.sliding_window
            o = F.scaled_dot_product_attention(q[:, :, None, :], keys, vals,
                                               attn_mask=mask[:, None, None, :], scale=self.scale)
            out = o[:, :, 0, :]
        return F.linear(out.reshape(T, -1), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))
