"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP in a layer of four norms.

As transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` compute them:

* embeddings scaled by sqrt(hidden_size), that factor first rounded to the activation dtype;
* each layer ``h += post_attn_norm(attn(input_norm(h)))``, ``h += post_ff_norm(mlp(pre_ff_norm(h)))``;
  Gemma's RMSNorm scales by ``1 + w`` and computes in float32 before casting back;
* a GeLU (tanh approximation) gated MLP; scores scaled by ``query_pre_attn_scalar ** -0.5``;
* sliding-window and global layers alternating (``cfg.layer_windows``);
* Gemma 2: attention scores soft-capped, ``cap * tanh(s / cap)`` (the backends' ``softcap``);
* Gemma 3: Gemma's RMSNorm over each head of q and k, and a RoPE base of the sliding layers' own
  (``cfg.local_rope_theta``) while the global layers take ``rope_theta`` and its scaling;
* the final logits soft-capped where config.json sets ``final_logit_softcapping`` (not in
  ``Gemma3ForConditionalGeneration``, which transformers computes without it).

``Gemma3ForConditionalGeneration`` checkpoints serve their text model: ``checkpoint_name`` maps its
tensors (``model.language_model.*``, or ``language_model.model.*`` in older files) to a text-only
model's names and leaves the vision tower and projector unloaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.attention import AttentionMetadata
from pdserve.engine.models.blocks import Attention, Weights, attention_block, gated_mlp
from pdserve.engine.models.decoder import CausalLM, pre_norm_tensor_names
from pdserve.engine.models.rope import rope_inv_freq

MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# (prefix in the checkpoint, prefix in a text-only model's names)
RENAMES = (
    ("model.language_model.", "model."),  # Gemma3ForConditionalGeneration, transformers >= 5
    ("language_model.model.", "model."),  # the same, as transformers 4 saved it
    ("language_model.lm_head.", "lm_head."),
)


def gemma_rms_norm(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Gemma2RMSNorm``: RMSNorm in float32 times ``1 + w``, cast back to x's dtype;
    ``weight1`` holds ``1 + w`` in float32 (``_plus_one``), [dim] or, for x [T, heads, dim], [heads,
    dim]. bfloat16 CPU tensors take one C++ pass (``csrc/elementwise_bf16.cpp``), the same float32
    arithmetic but for the order of the sum of squares."""
    fn = _cpu_norm_kernel() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    dim = x.shape[-1]
    if fn is not None and x.stride(-1) == 1 and (x.dim() == 2 or (x.dim() == 3 and x.stride(1) == dim)):
        out = torch.empty(x.shape, dtype=x.dtype)
        heads = 1 if x.dim() == 2 else x.shape[1]
        w = weight1.float().contiguous()
        fn(out.data_ptr(), heads * dim, x.data_ptr(), x.stride(0), w.data_ptr(), x.shape[0], heads, dim, float(eps),
           torch.get_num_threads())  # fmt: skip
        return out
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight1).to(x.dtype)


@functools.cache
def _cpu_norm_kernel():
    """``pdserve_gemma_rms_norm_bf16``, or None where the C++ kernels cannot be built here."""
    from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels

    try:
        return load_cpu_kernels().pdserve_gemma_rms_norm_bf16
    except KernelUnavailable:
        return None


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w.float()


class GeluTanhMLP:
    """down(gelu_tanh(gate(x)) * up(x)), gate|up in one GEMM (the ``GatedMLP``'s projections)."""

    def __init__(self, gate_up, down) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        inter = gate_up.shape[-1] // 2
        return self.down(F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:])


@dataclass
class GemmaLayer:
    """``h += post_attn(attn(x))``, ``h += post_ff(mlp(pre_ff(h)))``, returns ``next_norm(h)``: the
    next layer's input norm or the final norm. Norm weights hold ``1 + w`` in float32."""

    attn: Attention
    post_attn: torch.Tensor
    pre_ff: torch.Tensor
    post_ff: torch.Tensor
    mlp: GeluTanhMLP
    next_norm: torch.Tensor
    eps: float

    def __call__(self, h, x, cos, sin, meta, cache) -> torch.Tensor:
        h += gemma_rms_norm(self.attn(x, cos, sin, meta, cache), self.post_attn, self.eps)
        h += gemma_rms_norm(self.mlp(gemma_rms_norm(h, self.pre_ff, self.eps)), self.post_ff, self.eps)
        return gemma_rms_norm(h, self.next_norm, self.eps)


class GemmaLM(CausalLM):
    """The decoder with Gemma's scaled embeddings, per-layer RoPE bases and final soft-cap."""

    def __init__(self, cfg: ModelConfig, w: Weights, layers: list, first_norm, attention, ops) -> None:
        super().__init__(cfg, w, layers, first_norm, attention, ops)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(self.embed.dtype)  # as transformers rounds it
        self.local_inv_freq = None
        if cfg.local_rope_theta is not None:
            local = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
            self.local_inv_freq = rope_inv_freq(local).to(self.embed.device)
        self.sliding = [window is not None for window in cfg.layer_windows]

    def _local_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.local_inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | list, kv_cache
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed) * self.embed_scale  # the residual stream, updated in place
        rope = {False: self._rope(positions, h.dtype)}
        rope[True] = rope[False] if self.local_inv_freq is None else self._local_rope(positions, h.dtype)
        x = gemma_rms_norm(h, self.first_norm, self.cfg.rms_norm_eps)
        hook = self.layer_hook  # see CausalLM
        layers = zip(self.layers, kv_cache, self.sliding, self.layer_metas(meta))
        for i, (layer, cache, sliding, layer_meta) in enumerate(layers):
            x = layer(h, x, *rope[sliding], layer_meta, cache)
            if hook is not None:
                hook(i, cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def checkpoint_name(key: str) -> str | None:
    """A checkpoint tensor's name in the text model; None for the vision tower's and the rest."""
    for old, new in RENAMES:
        if key.startswith(old):
            return new + key[len(old) :]
    if key.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        return None
    return key if key.startswith("model.") or key == "lm_head.weight" else None


def tensor_names(cfg: ModelConfig) -> list[str]:
    # the pre-norm layout's tensors, and Gemma's two norms around the MLP beside its own
    return pre_norm_tensor_names(cfg, lambda i, p: [f"{p}{n}.weight" for n in (*NORMS[2:], *MLP)])


def build(cfg: ModelConfig, weights: Weights, attention, ops) -> CausalLM:
    layers, eps = [], cfg.rms_norm_eps
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = attention_block(cfg, weights, p + "self_attn.", attention(i), ops)
        if attn.qk_norm is not None:  # Gemma's norm over each head of q and k
            attn.qk_norm, attn.norm = _plus_one(attn.qk_norm), gemma_rms_norm
        last = i + 1 == cfg.num_layers
        nxt = weights["model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"]
        dense = gated_mlp(weights, *(p + n for n in MLP), ops)
        mlp = GeluTanhMLP(dense.gate_up, dense.down)
        post_attn, pre_ff, post_ff = (_plus_one(weights[f"{p}{n}.weight"]) for n in NORMS[1:])
        layers.append(GemmaLayer(attn, post_attn, pre_ff, post_ff, mlp, _plus_one(nxt), eps))
    first = _plus_one(weights["model.layers.0.input_layernorm.weight"])
    return GemmaLM(cfg, weights, layers, first, attention(0), ops)
