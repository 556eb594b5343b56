"""Attention backends over the paged KV cache, chosen once when the model runner starts.

* ``CpuPagedAttention``: one C++ kernel (``csrc/paged_attention.cpp``) for prefill and decode,
  reading each sequence's K/V in place through its block table: a packed prefill batch is one call
  per layer, no padding (1.4x faster than SDPA's fused kernel at 256 tokens).
* ``TorchAttention``: prefill runs SDPA on each sequence's fresh K/V (SDPA has no variable-length
  CPU kernel); decode gathers every sequence's blocks into a batch padded to the longest block
  table and runs masked SDPA. It runs on any device and is the reference the tests hold the
  others to; with Gemma 2's soft-capped scores both take transformers' eager arithmetic.
* On CUDA, ``attention_cuda.CudaVarlenAttention`` prefills the step in one varlen FlashAttention call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine.models.kernels import ATTENTION_SYMBOLS, KernelUnavailable, load_cpu_kernels

log = logging.getLogger(__name__)
BACKENDS = ("auto", "cpu-paged", "sdpa-prefill", "torch")


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, on the model's device.

    slot_mapping: [num_tokens] int64, the KV cache slot each input token writes.
    ``block_tables`` [num_seqs, max_blocks] int32 (rows padded with 0); ``context_lens``
    [num_seqs] int32, each sequence's KV positions, this step's tokens included;
    ``query_start_loc`` [num_seqs + 1] int32, where each sequence's tokens start in the batch (a
    decode step has one token per sequence, so it is 0..num_seqs).
    ``cu_seqlens`` holds the same offsets and ``context_lens_host`` the same lengths as host
    lists. A sequence's query rows are its last ``query_start_loc[b + 1] - query_start_loc[b]``
    positions: a prefill chunk may follow positions already in the cache (an earlier chunk, a
    cached prefix), and a step may mix prefill chunks with decode rows.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    cu_seqlens: list[int] | None = None
    context_lens_host: list[int] | None = None


class AttentionBackend(Protocol):
    """Prefill and decode attention for one model shape (``scale``: head_dim ** -0.5 unless the
    model says otherwise; ``softcap``: scores s become softcap * tanh(s / softcap) before the softmax)."""

    name: str

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim] (packed,
        causal per sequence; also already in k/v_cache [num_blocks, block_size, num_kv_heads,
        head_dim], which holds the positions before each sequence's rows too) -> [num_tokens,
        num_heads * head_dim]."""
        ...

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [num_seqs, num_heads, head_dim] (last dim contiguous), k/v_cache [num_blocks,
        block_size, num_kv_heads, head_dim] already holding this step's K/V -> [num_seqs,
        num_heads * head_dim]."""
        ...


class TorchAttention:
    """Prefill: per-sequence causal SDPA with GQA (a sliding window shorter than the sequence adds a
    mask). Decode: gather each sequence's blocks, padded to the longest, then masked SDPA."""

    name = "torch"

    def __init__(self, scale: float, sliding_window: int | None, softcap: float | None = None) -> None:
        self.scale, self.window, self.softcap = scale, sliding_window, softcap

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Lq, D], k/v [B, Hkv, L, D]; mask bool, broadcast to [B, H, Lq, L] (None: causal,
        Lq == L). SDPA, or with ``softcap`` transformers' eager Gemma 2 attention: scores * scale,
        capped, masked, softmax in float32."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _mask(self, nq: int, n: int, device: torch.device) -> torch.Tensor | None:
        """None (plain causal) when the ``nq`` queries are all ``n`` positions and the window is not
        shorter; else a bool [nq, n] mask where query i (position n - nq + i) sees key j iff j is not
        after it and, with a window, i - j < window (transformers' sliding-window rule)."""
        if nq == n and (self.window is None or n <= self.window):
            return None
        i = torch.arange(n - nq, n, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        mask = j <= i
        return mask & (i - j < self.window) if self.window is not None else mask

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        bounds, bs = meta.cu_seqlens, k_cache.shape[1]
        lens = meta.context_lens_host or meta.context_lens.tolist()
        for s in range(len(bounds) - 1):
            a, b, n = bounds[s], bounds[s + 1], lens[s]
            if n == b - a:  # the whole sequence is in this step: its fresh K/V
                self.attend_whole(q, k, v, out, a, b)
                continue
            # earlier positions are read back from the cache through the block table
            blocks = meta.block_tables[s, : -(-n // bs)].long()
            keys, vals = k_cache[blocks].flatten(0, 1)[:n], v_cache[blocks].flatten(0, 1)[:n]
            self._into(out, a, b, q, keys, vals, self._mask(b - a, n, q.device))
        return out.flatten(1)

    def attend_whole(self, q, k, v, out: torch.Tensor, a: int, b: int) -> None:
        """out[a:b] = causal attention of rows a..b-1 of q over this step's own k, v [T, heads, head_dim]
        (a sequence computed whole in this step)."""
        self._into(out, a, b, q, k[a:b], v[a:b], self._mask(b - a, b - a, q.device))

    def _into(self, out, a, b, q, keys, vals, mask) -> None:
        # 4-D [1, H, n, D] views take SDPA's fused CPU kernel (3-D inputs take a ~10x slower path)
        o = self._attend(q[a:b].transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], mask)
        out[a:b] = o[0].transpose(0, 1)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tables, lens = meta.block_tables.long(), meta.context_lens.long()
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, D]
        vals = v_cache[tables].flatten(1, 2).transpose(1, 2)
        pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        mask = pos < lens[:, None]  # [B, L]
        if self.window is not None:
            mask &= pos >= lens[:, None] - self.window
        o = self._attend(q[:, :, None, :], keys, vals, mask[:, None, None, :])
        return o[:, :, 0, :].flatten(1)


class CpuPagedAttention:
    """Prefill and decode with the C++ paged kernel (CPU tensors of float32, bfloat16 or float16)."""

    name = "cpu-paged"

    def __init__(
        self, scale: float, sliding_window: int | None, dtype: torch.dtype, softcap: float | None = None
    ) -> None:
        self.scale, self.window, self.softcap = scale, sliding_window, softcap
        self._fn = getattr(load_cpu_kernels(), ATTENTION_SYMBOLS[str(dtype).removeprefix("torch.")])

    def prefill(self, q, k, v, k_cache, v_cache, meta):
        return self.decode(q, k_cache, v_cache, meta)  # the kernel takes any number of rows per sequence

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        rows, num_heads, head_dim = q.shape
        tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
        if {tables.dtype, lens.dtype, starts.dtype} != {torch.int32} or q.stride(-1) != 1:
            raise TypeError(
                "cpu-paged attention needs int32 block_tables/context_lens/query_start_loc and a contiguous head_dim"
            )
        out = torch.empty((rows, num_heads * head_dim), dtype=q.dtype)
        self._fn(
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            starts.data_ptr(),
            lens.shape[0],
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            tables.shape[1],
            q.stride(0),
            self.scale,
            self.window or 0,
            self.softcap or 0.0,
            torch.get_num_threads(),
        )
        return out


class SdpaPrefillAttention(CpuPagedAttention):
    """The paged C++ kernel, except for the sequences a step computes whole (no cached positions):
    those go to ``TorchAttention.attend_whole`` (SDPA's fused causal kernel, 3-5x faster here on
    256-1,024-token bf16 prompts). Not batch-invariant: a position computed by a prefill gets other
    bits than by decode steps, so a preempted or migrated bfloat16 stream may diverge."""

    name = "sdpa-prefill"

    def __init__(
        self, scale: float, sliding_window: int | None, dtype: torch.dtype, softcap: float | None = None
    ) -> None:
        super().__init__(scale, sliding_window, dtype, softcap)
        self._whole = TorchAttention(scale, sliding_window, softcap)

    def prefill(self, q, k, v, k_cache, v_cache, meta):
        bounds = meta.cu_seqlens
        lens = meta.context_lens_host or meta.context_lens.tolist()
        rest = [s for s in range(len(bounds) - 1) if lens[s] != bounds[s + 1] - bounds[s]]
        if len(rest) == len(bounds) - 1:
            return self.decode(q, k_cache, v_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for s in range(len(bounds) - 1):
            if lens[s] == bounds[s + 1] - bounds[s]:
                self._whole.attend_whole(q, k, v, out, bounds[s], bounds[s + 1])
        if rest:  # decode rows and chunks after a cached prefix: the kernel, on their rows only
            rows = torch.cat([torch.arange(bounds[s], bounds[s + 1]) for s in rest])
            starts = [0]
            for s in rest:
                starts.append(starts[-1] + bounds[s + 1] - bounds[s])
            idx = torch.tensor(rest)
            sub = AttentionMetadata(
                True,
                meta.slot_mapping,
                meta.block_tables[idx].contiguous(),
                meta.context_lens[idx].contiguous(),
                torch.tensor(starts, dtype=torch.int32),
            )
            out.view(q.shape[0], -1)[rows] = self.decode(q[rows], k_cache, v_cache, sub)
        return out.flatten(1)


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> AttentionBackend:
    """The backend for ``name``: ``"auto"`` (on CPU the C++ paged kernel when it builds and fits the
    model's shape, on CUDA ``attention_cuda.cuda_backend``'s), ``"cpu-paged"``, ``"sdpa-prefill"``
    (``SdpaPrefillAttention``) or ``"torch"``; ``scale`` (default head_dim ** -0.5) and ``softcap``.

    Raises ValueError for an unknown name and KernelUnavailable when ``"cpu-paged"`` or
    ``"sdpa-prefill"`` is asked for but cannot run here. Logs the choice and, for ``"auto"``, why
    the kernel was not taken.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose {', '.join(BACKENDS)}")
    scale = head_dim**-0.5 if scale is None else scale
    if name == "torch":
        return TorchAttention(scale, sliding_window, softcap)
    if name == "auto" and device.type == "cuda":
        from pdserve.engine.models.attention_cuda import cuda_backend

        return cuda_backend(device, dtype, scale, sliding_window, softcap)
    try:
        if device.type != "cpu":
            raise KernelUnavailable(f"the paged C++ kernel runs on CPU, not {device.type}")
        lib = load_cpu_kernels()
        groups = num_heads // num_kv_heads
        if groups > lib.pdserve_max_groups() or head_dim > lib.pdserve_max_head_dim():
            raise KernelUnavailable(
                f"{groups} query heads per KV head / head_dim {head_dim} exceed the kernel's "
                f"{lib.pdserve_max_groups()} / {lib.pdserve_max_head_dim()}"
            )
        kind = SdpaPrefillAttention if name == "sdpa-prefill" else CpuPagedAttention
        backend = kind(scale, sliding_window, dtype, softcap)
    except KernelUnavailable as exc:
        if name != "auto":
            raise
        log.warning("attention backend: torch (%s)", exc)
        return TorchAttention(scale, sliding_window, softcap)
    log.info("attention backend: %s", backend.name)
    return backend
