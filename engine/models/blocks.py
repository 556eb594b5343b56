"""The building blocks the families' decoders are made of, over the paged KV cache.

Math follows the Hugging Face ``transformers`` implementations, so that greedy output is
token-identical to ``generate()`` in float32: rotate-half RoPE, grouped-query attention, SwiGLU MLP,
top-k routed experts. Each block holds its weights fused and laid out once for the device (q|k|v and
gate|up are one GEMM each, ``pdserve.engine.models.linear``; these projections and the experts'
are the linears ``--quantization`` quantizes, the MoE router is not); the attention backend
(``pdserve.engine.models.attention``) and elementwise ops (``pdserve.engine.models.ops``) are chosen at
start. ``attention_block``, ``gated_mlp`` and ``moe_block`` build them from Hugging Face tensor names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.attention import AttentionBackend, AttentionMetadata
from pdserve.engine.models.linear import Linear, fuse_rows, make_linear
from pdserve.engine.models.ops import ElementwiseOps, rms_norm

Weights = dict[str, torch.Tensor]


class Attention:
    """x [T, hidden] -> o_proj(attention) [T, hidden]: q|k|v in one GEMM, optionally RMSNorm over
    each head of q and k (``qk_norm``: the q weight repeated per query head, then k's), RoPE on q and
    k in place, this step's K/V written into the cache, then the backend."""

    def __init__(
        self,
        qkv: Linear,
        o: Linear,
        shape: tuple[int, int, int],
        backend: AttentionBackend,
        ops: ElementwiseOps,
        qk_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> None:
        self.qkv, self.o, self.backend, self.ops = qkv, o, backend, ops
        self.num_heads, self.num_kv_heads, self.head_dim = shape
        self.qk_norm, self.eps = qk_norm, eps
        self.norm = rms_norm  # the q/k norm's function (a family may set its own: Gemma's)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        """cache: this layer's [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        qkv = self.qkv(x)
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        if self.qk_norm is not None:
            qk.copy_(self.norm(qk, self.qk_norm, self.eps))
        if cos.shape[-1] == D:
            self.ops.rope_(qk, cos, sin)  # q and k at once, in place
        else:  # partial_rotary_factor: the first cos.shape[-1] dims of each head turn, the rest pass
            rot = qk[..., : cos.shape[-1]].contiguous()
            self.ops.rope_(rot, cos, sin)
            qk[..., : cos.shape[-1]] = rot
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        self.ops.write_kv(cache, k, v, meta.slot_mapping)
        if meta.is_prefill:
            out = self.backend.prefill(q, k, v, cache[0], cache[1], meta)
        else:
            out = self.backend.decode(q, cache[0], cache[1], meta)
        return self.o(out)


class GatedMLP:
    """down(silu(gate(x)) * up(x)), gate|up in one GEMM."""

    def __init__(self, gate_up: Linear, down: Linear, ops: ElementwiseOps) -> None:
        self.gate_up, self.down, self.ops = gate_up, down, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.ops.silu_mul(self.gate_up(x)))


class MoE:
    """Top-k routed experts (Shazeer et al. 2017; Mixtral, Qwen3-MoE): softmax over the router's
    logits in float32, the ``top_k`` largest, renormalised to sum to 1 when ``renormalize``; each
    expert runs once on the rows routed to it, and its outputs, scaled by their weights, are added
    in expert order (as transformers adds them)."""

    def __init__(self, router: Linear, experts: list[GatedMLP], top_k: int, renormalize: bool) -> None:
        self.router, self.experts, self.top_k, self.renormalize = router, experts, top_k, renormalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        order = torch.argsort(chosen.flatten(), stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()  # one host sync
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                picked = order[start : start + n]
                rows = picked // self.top_k
                out.index_add_(0, rows, expert(x[rows]) * weights[picked, None])
                start += n
        return out


def attention_block(
    cfg: ModelConfig, w: Weights, prefix: str, backend: AttentionBackend, ops: ElementwiseOps
) -> Attention:
    """The attention at ``prefix`` (``model.layers.{i}.self_attn.``): ``{q,k,v,o}_proj.weight``, their
    biases where present, ``{q,k}_norm.weight`` when ``cfg.qk_norm``."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    sizes = (H * D, Hkv * D, Hkv * D)
    qk_norm = None
    if cfg.qk_norm:
        q_w, k_w = w[prefix + "q_norm.weight"], w[prefix + "k_norm.weight"]
        qk_norm = torch.cat((q_w.expand(H, D), k_w.expand(Hkv, D)))  # [H + Hkv, D]
    return Attention(
        make_linear(
            fuse_rows(*(w[prefix + f"{x}_proj.weight"] for x in "qkv"), sizes=sizes),
            fuse_rows(*(w.get(prefix + f"{x}_proj.bias") for x in "qkv"), sizes=sizes),
            quantizable=True,
        ),
        make_linear(w[prefix + "o_proj.weight"], w.get(prefix + "o_proj.bias"), quantizable=True),
        (H, Hkv, D),
        backend,
        ops,
        qk_norm,
        cfg.rms_norm_eps,
    )


def gated_mlp(w: Weights, gate: str, up: str, down: str, ops: ElementwiseOps) -> GatedMLP:
    """A SwiGLU MLP from the tensor names of its three projections (``.weight``; ``.bias`` where present)."""
    size = w[gate + ".weight"].shape[0]
    return GatedMLP(
        make_linear(
            fuse_rows(w[gate + ".weight"], w[up + ".weight"], sizes=(size, size)),
            fuse_rows(w.get(gate + ".bias"), w.get(up + ".bias"), sizes=(size, size)),
            quantizable=True,
        ),
        make_linear(w[down + ".weight"], w.get(down + ".bias"), quantizable=True),
        ops,
    )


def moe_block(cfg: ModelConfig, w: Weights, router: str, expert_names, ops: ElementwiseOps) -> MoE:
    """Routed experts: ``router`` the gate's weight name, ``expert_names(e)`` expert e's (gate, up,
    down) prefixes."""
    experts = [gated_mlp(w, *expert_names(e), ops) for e in range(cfg.num_experts)]
    return MoE(make_linear(w[router]), experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def unstack_experts(w: Weights, stacked: str, num_experts: int, expert_names) -> None:
    """Split transformers' stacked expert tensors, ``{stacked}gate_up_proj`` [E, 2 * inter, hidden]
    and ``{stacked}down_proj`` [E, hidden, inter], into per-expert weights named by
    ``expert_names(e)`` (gate, up, down prefixes), in place; nothing when the checkpoint has none."""
    gate_up = w.pop(stacked + "gate_up_proj", None)
    if gate_up is None:
        return
    down = w.pop(stacked + "down_proj")
    for e in range(num_experts):
        gate, up, down_name = expert_names(e)
        w[gate + ".weight"], w[up + ".weight"] = gate_up[e].chunk(2, dim=0)
        w[down_name + ".weight"] = down[e]


def attention_tensor_names(cfg: ModelConfig, prefix: str) -> list[str]:
    """Tensors ``attention_block`` needs at ``prefix``."""
    names = [prefix + f"{x}_proj.weight" for x in "qkvo"]
    if cfg.attention_bias:
        names += [prefix + f"{x}_proj.bias" for x in "qkv"]
    if cfg.qk_norm:
        names += [prefix + "q_norm.weight", prefix + "k_norm.weight"]
    return names
