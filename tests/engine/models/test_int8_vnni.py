"""The int8 x int8 CPU kernel (engine/models/csrc/int8_linear.cpp) that ``Int8Linear`` runs for
decode-sized bfloat16 calls where the CPU has AVX512-VNNI: against the dequantized weight, row by
row independent of the batch, and where it is not taken. Skipped on CPUs without AVX512-VNNI.

Tolerance, a bound rather than a measurement: besides the weight's quantization (which the reference
shares), each input is rounded to int8 per block of 16 inputs, off by at most half a step, 1/254 of
the block's largest |x|; so output n is off by at most sum over blocks of that times the block's
sum of |w[n, k]| (``activation_bound``), plus bfloat16's rounding of the output and of the scales
the reference uses (2**-7 of |y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.quant import Int8Linear

SHAPES = [(96, 576), (208, 1536), (1000, 64)]  # [out_features, in_features]
BLOCK = 16  # inputs per activation scale (csrc/int8_linear.cpp)


def activation_bound(x: torch.Tensor, deq: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most that rounding x [M, K] to int8 per block of 16 inputs moves x @ deq.T, plus
    bfloat16's rounding (see the module docstring)."""
    m, k = x.shape
    half_step = x.float().abs().view(m, k // BLOCK, BLOCK).amax(-1) / 254  # [M, K / 16]
    weight = deq.abs().view(deq.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, K / 16]
    return half_step @ weight.T + (x.float() @ deq.T).abs() * 2**-7 + 1e-6


def _linear(shape, seed=0) -> tuple[Int8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    lin = Int8Linear(w, None)
    if not lin.vnni_rows:
        pytest.skip("no AVX512-VNNI here: Int8Linear keeps torch's kernel")
    return lin, g


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_dequantized_weight(shape, threads):
    lin, g = _linear(shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, lin.vnni_rows + 1):
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            x[:, 3] *= 30  # an outlier input: only its own block's scale coarsens
            ref = x.float() @ lin.dequantized().T
            y = lin(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
            over = (y.float() - ref).abs() - activation_bound(x, lin.dequantized())
            assert over.max() <= 0, (rows, over.max().item())
            assert (y.float() - ref).abs().max() > 0  # the activations were quantized
    finally:
        torch.set_num_threads(before)


def test_a_row_does_not_depend_on_the_batch():
    lin, g = _linear((208, 1536))
    x = torch.randn(lin.vnni_rows, 1536, generator=g).bfloat16()
    whole = lin(x)
    for i in range(len(x)):
        assert torch.equal(lin(x[i : i + 1])[0], whole[i])


def test_not_taken_where_it_cannot_run():
    _linear((64, 64))  # skips without VNNI
    assert Int8Linear(torch.randn(64, 96).bfloat16(), None).vnni_rows == 0  # in_features % 64
    assert Int8Linear(torch.randn(64, 64), None).vnni_rows == 0  # float32 activations keep exact weight-only math
    lin = Int8Linear(torch.randn(64, 64).bfloat16(), None)
    x = torch.randn(lin.vnni_rows + 1, 64).bfloat16()  # more rows: torch's weight-only kernel
    torch.testing.assert_close(lin(x), torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales))
