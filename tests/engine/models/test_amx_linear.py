"""The AMX tile kernel (engine/models/csrc/amx_linear.cpp) that bfloat16 ``DenseLinear`` runs on
CPUs with AMX, over the same packed weight as the AVX-512 kernel: its output against float64
arithmetic at every shape of tail (channels in blocks of 16 and 32, rows in blocks of 16 and 32, rows
past one block of rows, inputs in spans), each row the same bits whatever the number of rows beside it, and where
``make_linear`` takes it. The kernel tests skip on CPUs without AMX; the choice tests run everywhere.

Tolerance: as tests/engine/models/test_dense_linear.py's (products of bfloat16 numbers are exact in
float32, summed in float32 and rounded once to bfloat16).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models import kernels, linear
from pdserve.engine.models.kernels import DenseLinear, KernelUnavailable, dense_linear, load_cpu_kernels

# [out_features, in_features]: 16-channel blocks even (96) and odd (208, 1008, 48); in_features 32 and up
SHAPES = [(96, 576), (208, 1536), (1008, 64), (48, 32)]
# one or two 16-row tiles in the last block; up to 32 rows all inputs at once, more in spans of 256 inputs
# (576, 1536), 300 rows in two blocks of rows (256 and 44)
ROWS = [1, 3, 15, 16, 17, 31, 32, 33, 48, 100, 300]


def _lib():
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"no CPU kernels here: {exc}")
    if not (lib.pdserve_bf16_amx_linear_supported() and lib.pdserve_bf16_linear_supported()):
        pytest.skip("no AMX bfloat16 tiles on this CPU")
    return lib


def _weight(shape, seed=0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def _linear(lib, w, b=None) -> DenseLinear:
    return DenseLinear(lib.pdserve_bf16_amx_linear, w, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_tiles_match_exact_arithmetic(shape, threads, bias):
    lib = _lib()
    w, b = _weight(shape), _weight(shape[:1], seed=2) if bias else None
    lin = _linear(lib, w, b)
    g = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in ROWS:
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            ref = x.double() @ w.double().T + (b.double() if bias else 0)
            bound = ref.abs() * 2**-8 + (x.double().abs() @ w.double().abs().T) * shape[1] * 2**-23 + 1e-6
            err = (lin(x).double() - ref).abs()
            assert (err - bound).max() <= 0, (rows, err.max().item())
    finally:
        torch.set_num_threads(before)


def test_each_row_is_the_same_bits_alone_or_beside_any_number_of_rows():
    lin = _linear(_lib(), _weight((208, 1536)))
    x = torch.randn(290, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = lin(x)
    # alone (a decode row), then at another place in a tile, in the padded block or in the second block of rows
    for i in (0, 13, 31, 40, 69, 255, 256, 289):
        assert torch.equal(lin(x[i : i + 1]), batch[i : i + 1]), i
        assert torch.equal(lin(x[i : i + 5]), batch[i : i + 5]), i


def test_make_linear_on_an_amx_cpu_takes_the_tiles(monkeypatch):
    lib = _lib()
    monkeypatch.setattr(kernels, "has_amx", lambda: True)
    lin = linear.make_linear(_weight((64, 64)))
    assert isinstance(lin, DenseLinear) and lin.fn is lib.pdserve_bf16_amx_linear


def test_cpus_without_amx_never_take_the_tiles(monkeypatch):
    try:
        load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"no CPU kernels here: {exc}")
    monkeypatch.setattr(kernels, "has_amx", lambda: False)
    lin = dense_linear(_weight((64, 64)), None)
    assert lin is None or lin.fn is not load_cpu_kernels().pdserve_bf16_amx_linear
