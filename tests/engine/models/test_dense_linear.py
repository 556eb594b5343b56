"""The dense CPU kernels (engine/models/csrc/dense_linear.cpp) that ``make_linear`` picks for
bfloat16 weights (AVX512-BF16) and float32 weights (AVX-512F): their output
against float64 arithmetic, row by row independent of the batch, and where they are not taken. The
kernel tests skip on CPUs without the instructions; the refusal tests run everywhere.

Tolerance, a bound rather than a measurement: products of bfloat16 numbers are exact in float32 and
summed in float32, so the output is the exact sum rounded once to bfloat16 (2**-8 of |y|), plus
float32's summation error over K terms (K * 2**-24 of sum |x w|); float32 has that summation error
and its own rounding of each product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.models import kernels, linear
from pdserve.engine.models.kernels import DENSE_KERNELS, DenseLinear, KernelUnavailable, dense_linear, load_cpu_kernels

SHAPES = [(96, 576), (208, 1536), (1008, 64), (32, 6)]  # [out_features, in_features]; K / 2 odd in the last


DTYPES = [torch.bfloat16, torch.float32]


def _kernel(dtype=torch.bfloat16):
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"no CPU kernels here: {exc}")
    symbol, _ = DENSE_KERNELS[dtype]
    if not getattr(lib, symbol + "_supported")():
        pytest.skip(f"no kernel for {dtype} on this CPU: its linears keep oneDNN")
    return getattr(lib, symbol)


def _weight(shape, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    rounding = 2**-8 if x.dtype == torch.bfloat16 else 2**-23
    return ref.abs() * rounding + (x.double().abs() @ w.double().abs().T) * x.shape[-1] * 2**-23 + 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_exact_arithmetic(dtype, shape, threads, bias):
    w, b = _weight(shape, dtype=dtype), _weight(shape[:1], seed=2, dtype=dtype) if bias else None
    lin = DenseLinear(_kernel(dtype), w, b)
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [1, 2, 3, 7, 8, 9, 17, 40]:  # the kernel runs 8 rows a pass: whole passes and a rest
            x = torch.randn(rows, shape[1], generator=g).to(dtype)
            ref = x.double() @ w.double().T + (b.double() if bias else 0)
            err = (lin(x).double() - ref).abs()
            assert (err - _bound(x, w, ref)).max() <= 0, (rows, err.max().item())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_row_is_the_same_bits_alone_or_in_a_batch(dtype):
    lin = DenseLinear(_kernel(dtype), _weight((208, 1536), dtype=dtype), None)
    x = torch.randn(19, 1536, generator=torch.Generator().manual_seed(3)).to(dtype)
    batch = lin(x)
    for i in (0, 7, 8, 18):
        assert torch.equal(lin(x[i : i + 1]), batch[i : i + 1]), i


def test_leading_dims_strided_input_and_the_unpacked_weight():
    lin = DenseLinear(_kernel(), w := _weight((64, 96)), None)
    x = torch.randn(2, 3, 192).bfloat16()[..., ::2]  # not contiguous
    assert torch.equal(lin(x), lin(x.reshape(6, 96)).view(2, 3, 64))
    assert torch.equal(lin.weight, w)
    with pytest.raises(TypeError, match="takes torch.bfloat16 activations, not torch.float32"):
        lin(torch.randn(1, 96))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_make_linear_picks_the_kernel_where_it_runs(monkeypatch, dtype):
    _kernel(dtype)
    monkeypatch.setattr(kernels, "has_amx", lambda: False)
    w = _weight((64, 64), dtype=dtype)
    assert isinstance(linear.make_linear(w), DenseLinear)
    assert torch.allclose(linear.make_linear(w)(x := torch.randn(3, 64).to(dtype)).float(), F.linear(x, w).float(),
                          rtol=2**-7, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize(
    "weight, why",
    [
        (torch.zeros(64, 64, dtype=torch.float16), "float16"),
        (torch.zeros(40, 64), "float32, out_features not a multiple of 16"),
        (torch.zeros(40, 64, dtype=torch.bfloat16), "out_features not a multiple of 16"),
        (torch.zeros(64, 63, dtype=torch.bfloat16), "odd in_features"),
    ],
)
def test_weights_the_kernel_does_not_take(weight, why):
    assert dense_linear(weight, None) is None, why
    assert not isinstance(linear.make_linear(weight), DenseLinear), why


@pytest.mark.parametrize("dtype, shape", [(torch.float32, (64, 64)), (torch.bfloat16, (64, 48))], ids=str)
def test_amx_cpus_keep_onednn_for_float32_and_in_features_not_a_multiple_of_32(monkeypatch, dtype, shape):
    monkeypatch.setattr(kernels, "has_amx", lambda: True)
    assert dense_linear(_weight(shape, dtype=dtype), None) is None
