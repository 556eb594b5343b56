"""Fused bf16 and float32 elementwise kernels against transformers' eager arithmetic (``TorchOps``)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.ops import CpuBf16Ops, CpuF32Ops, TorchOps, select_ops

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
    assert select_ops(torch.device("cpu"), torch.float32).name == "cpu-f32"
    assert select_ops(torch.device("cpu"), torch.float16).name == "torch"


def f32_ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 units in the last place (same-sign values)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.fixture(scope="module")
def fused_f32():
    return CpuF32Ops()


@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 768), (300, 96), (3, 40)])  # 40: a 16-lane tail
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_f32(fused_f32, rows, hidden, with_delta):
    gen = torch.Generator().manual_seed(rows + hidden)
    h = 3 * torch.randn(rows, hidden, generator=gen)
    delta = torch.randn(rows, hidden, generator=gen) if with_delta else None
    weight = 1 + 0.2 * torch.randn(hidden, generator=gen)
    h_ref, h_ours = h.clone(), h.clone()
    want = TorchOps().add_rms_norm(h_ref, delta, weight, 1e-5)
    got = fused_f32.add_rms_norm(h_ours, delta, weight, 1e-5)
    assert torch.equal(h_ours, h_ref)  # the residual add is bit-exact
    # The scale 1 / sqrt(mean(r^2) + eps) differs where the sum of squares rounds otherwise (torch's
    # cascade sum in float32, ours in float64) and torch's rsqrt does: a few ulps, and no further from
    # the float64 result than torch's own.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    r = h_ref.double()
    exact = weight.double() * r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (got.double() - exact).abs().max() <= 1.5 * (want.double() - exact).abs().max()


@pytest.mark.parametrize("rows, inter", [(1, 32), (9, 2048), (2, 40)])
def test_silu_mul_f32(fused_f32, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = 4 * torch.randn(rows, 2 * inter, generator=gen)
    gate_up[0, :4] = torch.tensor([-90.0, 90.0, 0.0, -0.0])  # exp's clamps and zeros
    want, got = TorchOps().silu_mul(gate_up), fused_f32.silu_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)  # exp_approx16: 2 ulp against SLEEF's 1


@pytest.mark.parametrize("heads, head_dim", [(16, 64), (3, 128), (2, 16)])
def test_rope_f32_in_place_on_a_strided_view_is_bit_exact(fused_f32, heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    rows = 11
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=gen)
    angles = torch.randn(rows, head_dim // 2, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    ref, ours = qkv.clone(), qkv.clone()
    TorchOps().rope_(ref[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    fused_f32.rope_(ours[:, : heads * head_dim].view(rows, heads, head_dim), cos, sin)
    assert torch.equal(ours, ref)  # each product rounded before the sum, as torch's kernels: bit-exact
    assert torch.equal(ours[:, heads * head_dim :], qkv[:, heads * head_dim :])
