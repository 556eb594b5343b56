"""The bfloat16 CPU kernel (engine/models/csrc/bf16_linear.cpp) that ``make_linear`` picks for
bfloat16 weights on CPUs with AVX512-BF16 and no AMX: its layout, its output against float32
arithmetic, row by row independent of the batch, and where it is not taken. The kernel tests skip
on CPUs without AVX512-BF16; the layout and refusal tests run everywhere.

Tolerance, a bound rather than a measurement: products of bfloat16 numbers are exact in float32 and
summed in float32, so the output is the float32 reference rounded once to bfloat16 (2**-8 of |y|),
plus float32's summation error over K terms (K * 2**-24 of sum |x w|).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import kernels, linear
from pdserve.engine.models.kernels import Bf16Linear, KernelUnavailable, bf16_linear, load_cpu_kernels

SHAPES = [(96, 576), (208, 1536), (1008, 64), (32, 6)]  # [out_features, in_features]; K / 2 odd in the last


def _kernel():
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"no CPU kernels here: {exc}")
    if not lib.pdserve_bf16_linear_supported():
        pytest.skip("no AVX512-BF16 here: bfloat16 linears keep oneDNN")
    return lib.pdserve_bf16_linear


def _weight(shape, seed=0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return ref.abs() * 2**-8 + (x.float().abs() @ w.float().abs().T) * x.shape[-1] * 2**-24 + 1e-6


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32_arithmetic(shape, threads, bias):
    lin = Bf16Linear(_kernel(), w := _weight(shape), b := _weight(shape[:1], seed=2) if bias else None)
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [1, 2, 3, 7, 8, 9, 17, 40]:  # the kernel runs 8 rows a pass: whole passes and a rest
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            ref = x.float() @ w.float().T + (b.float() if bias else 0)
            err = (lin(x).float() - ref).abs()
            assert (err - _bound(x, w, ref)).max() <= 0, (rows, err.max().item())
    finally:
        torch.set_num_threads(before)


def test_each_row_is_the_same_bits_alone_or_in_a_batch():
    lin = Bf16Linear(_kernel(), _weight((208, 1536)), None)
    x = torch.randn(19, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = lin(x)
    for i in (0, 7, 8, 18):
        assert torch.equal(lin(x[i : i + 1]), batch[i : i + 1]), i


def test_leading_dims_strided_input_and_the_unpacked_weight():
    lin = Bf16Linear(_kernel(), w := _weight((64, 96)), None)
    x = torch.randn(2, 3, 192).bfloat16()[..., ::2]  # not contiguous
    assert torch.equal(lin(x), lin(x.reshape(6, 96)).view(2, 3, 64))
    assert torch.equal(lin.weight, w)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        lin(torch.randn(1, 96))


def test_make_linear_picks_the_kernel_where_it_runs(monkeypatch):
    _kernel()
    monkeypatch.setattr(kernels, "has_amx", lambda: False)
    w = _weight((64, 64))
    assert isinstance(linear.make_linear(w), Bf16Linear)
    assert torch.allclose(linear.make_linear(w)(x := torch.randn(3, 64).bfloat16()).float(), F.linear(x, w).float(),
                          rtol=2**-7, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize(
    "weight, why",
    [
        (torch.zeros(64, 64), "float32"),
        (torch.zeros(40, 64, dtype=torch.bfloat16), "out_features not a multiple of 16"),
        (torch.zeros(64, 63, dtype=torch.bfloat16), "odd in_features"),
    ],
)
def test_weights_the_kernel_does_not_take(weight, why):
    assert bf16_linear(weight, None) is None, why
    assert not isinstance(linear.make_linear(weight), Bf16Linear), why


def test_amx_cpus_keep_onednn(monkeypatch):
    monkeypatch.setattr(kernels, "has_amx", lambda: True)
    assert bf16_linear(_weight((64, 64)), None) is None
