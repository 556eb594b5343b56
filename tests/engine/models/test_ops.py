"""Fused bf16 elementwise kernels against transformers' eager arithmetic (``TorchOps``)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.ops import CpuBf16Ops, TorchOps, select_ops

BF16 = torch.bfloat16


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.fixture(scope="module")
def fused():
    return CpuBf16Ops()


@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 768), (300, 96)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(fused, rows, hidden, with_delta):
    gen = torch.Generator().manual_seed(rows + hidden)
    h = (3 * torch.randn(rows, hidden, generator=gen)).to(BF16)
    delta = torch.randn(rows, hidden, generator=gen).to(BF16) if with_delta else None
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(BF16)
    h_ref, h_ours = h.clone(), h.clone()
    want = TorchOps().add_rms_norm(h_ref, delta, weight, 1e-5)
    got = fused.add_rms_norm(h_ours, delta, weight, 1e-5)
    assert torch.equal(h_ours, h_ref)  # the residual add is bit-exact
    assert ulps_apart(got, want).max() <= 1
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("rows, inter", [(1, 32), (9, 2048)])
def test_silu_mul(fused, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (2 * torch.randn(rows, 2 * inter, generator=gen)).to(BF16)
    want, got = TorchOps().silu_mul(gate_up), fused.silu_mul(gate_up)
    assert got.shape == (rows, inter)
    assert ulps_apart(got, want).max() <= 1
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("heads, head_dim", [(16, 64), (3, 128), (2, 16)])
def test_rope_in_place_on_a_strided_view(fused, heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    rows = 11
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen).to(BF16)  # 2 extra heads, like v
    angles = torch.randn(rows, head_dim // 2, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    ref, ours = qkv.clone(), qkv.clone()
    TorchOps().rope_(ref[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    fused.rope_(ours[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    assert torch.equal(ours, ref)  # same rounding after every op: bit-exact
    assert torch.equal(ours[:, heads * head_dim :], qkv[:, heads * head_dim :])  # the rest untouched


@pytest.mark.parametrize("rows", [1, 5])
def test_write_kv_puts_each_row_at_its_slot_from_strided_views(fused, rows):
    heads, kv_heads, head_dim, blocks, block_size = 4, 2, 16, 3, 4
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(BF16)
    ref, ours = cache.clone(), cache.clone()
    TorchOps().write_kv(ref, k, v, slots)
    fused.write_kv(ours, k, v, slots)
    assert torch.equal(ours, ref)
    flat = ours.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    assert (ours != cache).any()


@pytest.mark.parametrize("heads", [0, 1, 4])  # 0: a [rows, hidden] tensor; else q/k heads of a q|k|v row
def test_gemma_rms_norm_kernel_matches_torch(heads):
    from pdserve.engine.models.families import gemma

    gen = torch.Generator().manual_seed(heads)
    rows, dim = 7, 80  # 80: a tail of 16-lane vectors
    if heads:
        qkv = (3 * torch.randn(rows, (heads + 2) * dim, generator=gen)).to(BF16)
        x = qkv[:, : heads * dim].view(rows, heads, dim)  # strided: the rows skip the 2 extra heads
        weight1 = 1 + 0.2 * torch.randn(heads, dim, generator=gen)
    else:
        x = (3 * torch.randn(rows, dim, generator=gen)).to(BF16)
        weight1 = 1 + 0.2 * torch.randn(dim, generator=gen)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight1).to(BF16)
    got = gemma.gemma_rms_norm(x, weight1, 1e-6)
    assert gemma._cpu_norm_kernel() is not None and got.shape == x.shape
    assert ulps_apart(got, want).max() <= 1
    assert (got == want).float().mean() > 0.95


def test_selection():
    assert select_ops(torch.device("cpu"), BF16).name == "cpu-bf16"
    assert select_ops(torch.device("cpu"), torch.float32).name == "torch"  # the exact float32 path
