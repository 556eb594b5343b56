"""Soft-capped attention (Gemma 2's ``attn_logit_softcapping``) with a scale other than head_dim ** -0.5:
both backends against a float64 eager reference, decode and prefill, with and without a window."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.attention import AttentionMetadata, CpuPagedAttention, TorchAttention, select_backend
from tests.engine.models.test_attention import TOL, contiguous_kv, decode_metadata, random_paged_batch

SCALE, CAP = 0.3, 2.0  # scores of random q, k at this scale reach well beyond the cap


def make_backend(name: str, dtype: torch.dtype, window: int | None):
    if name == "torch":
        return TorchAttention(SCALE, window, CAP)
    return CpuPagedAttention(SCALE, window, dtype, CAP)


def reference(q, keys, vals, window):
    """q [H, D] over keys/vals [n, Hkv, D], its own position last: scores * scale, capped, softmax."""
    groups = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, n, D]
    v = vals.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = (k @ q.double()[:, :, None])[..., 0] * SCALE  # [H, n]
    scores = torch.tanh(scores / CAP) * CAP
    if window:
        scores[:, : max(0, keys.shape[0] - window)] = float("-inf")
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "cpu-paged"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: Gemma's
def test_decode_and_prefill_match_the_capped_reference(backend, window, dtype, head_dim):
    lens, heads, kv_heads, block_size = [1, 9, 40], 4, 1, 16
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables, table_tensor = random_paged_batch(lens, block_size, kv_heads, head_dim, dtype, gen)
    attn = make_backend(backend, dtype, window)
    tol = TOL[dtype]
    # decode: one query per sequence, the last of its positions
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    meta = decode_metadata(lens, table_tensor)
    out = attn.decode(q, k_cache, v_cache, meta)
    for i, n in enumerate(lens):
        keys, vals = (contiguous_kv(c, tables[i], n, block_size) for c in (k_cache, v_cache))
        want = reference(q[i], keys, vals, window)
        torch.testing.assert_close(out[i].view(heads, head_dim).double(), want, atol=tol, rtol=tol)
    # prefill: every position of every sequence, causal
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], heads, head_dim, generator=gen).to(dtype)
    slots = torch.cat(
        [
            torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(n)])
            for t, n in zip(tables, lens)
        ]
    )
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    lens_t, cu_t = torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32)
    out = attn.prefill(q, k, v, k_cache, v_cache, AttentionMetadata(True, slots, table_tensor, lens_t, cu_t, cu))
    for s in range(len(lens)):
        for i in range(cu[s], cu[s + 1]):
            want = reference(q[i], k[cu[s] : i + 1], v[cu[s] : i + 1], window)
            torch.testing.assert_close(out[i].view(heads, head_dim).double(), want, atol=tol, rtol=tol)


def test_select_backend_passes_scale_and_softcap():
    for name in ("torch", "auto"):
        backend = select_backend(name, torch.device("cpu"), torch.float32, 4, 1, 256, 512, SCALE, CAP)
        assert (backend.scale, backend.softcap, backend.window) == (SCALE, CAP, 512)
    assert select_backend("torch", torch.device("cpu"), torch.float32, 4, 1, 64, None).scale == 64**-0.5
