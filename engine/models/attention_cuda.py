"""Prefill attention on CUDA: one variable-length FlashAttention call per layer for the whole step.

``TorchAttention`` prefills each sequence with its own SDPA call; on a GPU those calls are bound by
the host (one 32-prompt prefill step of the embedded llama-80m: 211 ms of host time against 17 ms
of device time on an H200, most of it in 384 SDPA calls; docs/measurements.md). ``CudaVarlenAttention``
packs the step instead: the queries as they are, [num_tokens, num_heads, head_dim], and each
sequence's keys and values (this step's own for a sequence computed whole, its cached positions
read through the block table and this step's after them otherwise) into one call of
``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2's varlen kernel (Dao, 2023). Its causal
mask aligns a sequence's queries with the end of its keys, as a chunk after cached positions needs.
Decode steps stay ``TorchAttention``'s (captured in CUDA graphs, ``engine/decode_graphs.py``).

FlashAttention takes float16 and bfloat16 only and applies no soft-cap: float32 (the exact path)
and Gemma 2's soft-capped scores keep ``TorchAttention``.
"""

from __future__ import annotations

import inspect
import logging

import torch

from pdserve.engine.models.attention import AttentionMetadata, TorchAttention

log = logging.getLogger(__name__)

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.9
    varlen_attn = None

# torch 2.13 asks for enable_gqa=True when the keys have fewer heads; 2.11's kernel takes them as they are
_GQA_FLAG = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def cuda_backend(
    device: torch.device, dtype: torch.dtype, scale: float, window: int | None, softcap: float | None
) -> TorchAttention:
    """``--attention-backend auto`` on CUDA: ``CudaVarlenAttention`` where it runs, else
    ``TorchAttention`` (the reason logged)."""
    why = varlen_available(device, dtype, softcap)
    if why is not None:
        log.info("attention backend: torch (%s)", why)
        return TorchAttention(scale, window, softcap)
    log.info("attention backend: cuda-varlen")
    return CudaVarlenAttention(scale, window, softcap)


def varlen_available(device: torch.device, dtype: torch.dtype, softcap: float | None) -> str | None:
    """None when ``CudaVarlenAttention`` can run here, else why not (for the log)."""
    if device.type != "cuda":
        return f"varlen FlashAttention runs on CUDA, not {device.type}"
    if varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention takes float16 or bfloat16, not {dtype}"
    if softcap is not None:
        return "FlashAttention applies no soft-cap of the scores"
    return None


class CudaVarlenAttention(TorchAttention):
    """Prefill: one varlen FlashAttention call over the step's packed sequences. Decode: ``TorchAttention``'s."""

    name = "cuda-varlen"

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        bounds, bs = meta.cu_seqlens, k_cache.shape[1]
        lens = meta.context_lens_host or meta.context_lens.tolist()
        queries = [bounds[s + 1] - bounds[s] for s in range(len(lens))]
        if queries == lens:  # every sequence is computed whole: this step's own K/V, as they are
            keys, vals, cu_k = k, v, meta.query_start_loc
        else:  # each sequence's positions read back from the cache (this step's are there too)
            keys, vals = [], []
            for s, n in enumerate(lens):
                blocks = meta.block_tables[s, : -(-n // bs)].long()
                keys.append(k_cache[blocks].flatten(0, 1)[:n])
                vals.append(v_cache[blocks].flatten(0, 1)[:n])
            keys, vals = torch.cat(keys), torch.cat(vals)
            cu_k = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(q.device)
        window = (-1, 0) if self.window is None else (self.window - 1, 0)  # transformers: i - j < window
        kw = {"enable_gqa": True} if _GQA_FLAG and k.shape[1] != q.shape[1] else {}
        cu_q, scale = meta.query_start_loc, self.scale
        out = varlen_attn(q, keys, vals, cu_q, cu_k, max(queries), max(lens), scale=scale, window_size=window, **kw)
        return out.flatten(1)
