"""CudaVarlenAttention (engine/models/attention_cuda.py) packs a prefill step for one varlen call:
checked on CPU with a reference varlen kernel in its place (per-sequence SDPA with the causal mask
aligned to the end of each sequence's keys, as FlashAttention's), against TorchAttention in float32.
The FlashAttention kernel itself runs on a GPU only (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import attention_cuda
from pdserve.engine.models.attention import AttentionMetadata, TorchAttention, select_backend
from pdserve.engine.models.attention_cuda import CudaVarlenAttention, varlen_available

H, HKV, D, BS = 6, 2, 16, 4


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    out = torch.empty_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
    for s in range(len(cq) - 1):
        qs, ks, vs = q[cq[s] : cq[s + 1]], k[ck[s] : ck[s + 1]], v[ck[s] : ck[s + 1]]
        i = torch.arange(len(ks) - len(qs), len(ks))[:, None]
        j = torch.arange(len(ks))[None, :]
        mask = (j <= i) & ((i - j <= window_size[0]) if window_size[0] >= 0 else True)
        o = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (qs, ks, vs)), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[cq[s] : cq[s + 1]] = o[0].transpose(0, 1)
    return out


def _step(cached: tuple[int, ...], new: tuple[int, ...], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, new)]
    tables, at = [], 0
    for n in lens:
        tables.append(list(range(at, at - (-n // BS))))
        at = tables[-1][-1] + 1
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache, v_cache = torch.randn(at, BS, HKV, D, generator=gen), torch.randn(at, BS, HKV, D, generator=gen)
    k, v = (
        torch.cat([c[bt[s, : len(tables[s])].long()].flatten(0, 1)[cached[s] : lens[s]] for s in range(len(lens))])
        for c in (k_cache, v_cache)
    )
    cu = [0, *torch.tensor(new).cumsum(0).tolist()]
    meta = AttentionMetadata(
        True,
        torch.zeros(sum(new), dtype=torch.int64),
        bt,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32),
        cu_seqlens=cu,
        context_lens_host=lens,
    )
    return torch.randn(sum(new), H, D, generator=gen), k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("cached", [(0, 0, 0), (0, 9, 21)])
def test_packed_step_equals_per_sequence_attention(monkeypatch, cached, window):
    monkeypatch.setattr(attention_cuda, "varlen_attn", reference_varlen)
    args = _step(cached, (5, 11, 1))
    ref = TorchAttention(D**-0.5, window).prefill(*args)
    out = CudaVarlenAttention(D**-0.5, window).prefill(*args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_where_it_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "CUDA, not cpu" in varlen_available(cpu, torch.bfloat16, None)
    assert "float16 or bfloat16" in varlen_available(cuda, torch.float32, None)
    assert "soft-cap" in varlen_available(cuda, torch.bfloat16, 50.0)
    # auto on CPU never picks it
    assert select_backend("auto", cpu, torch.float32, H, HKV, D, None).name != "cuda-varlen"
