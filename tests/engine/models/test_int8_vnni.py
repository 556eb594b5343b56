"""The int8 x int8 CPU kernel (engine/models/csrc/quant_linear.cpp) that ``Int8Linear`` runs for
bfloat16 calls of up to ``vnni_max_rows()`` rows where the CPU has AVX512-VNNI: its packed layout,
its output against the dequantized weight, row by row independent of the batch, and where it is not
taken. The kernel tests skip on CPUs without AVX512-VNNI.

Tolerance, a bound rather than a measurement: besides the weight's quantization (which the reference
shares), each input is rounded to int8 per block of 32 inputs, off by at most half a step, 1/254 of
the block's largest |x|; so output n is off by at most sum over blocks of that times the block's
sum of |w[n, k]| (``activation_bound``), plus bfloat16's rounding of the output and of the scales
the reference uses (2**-7 of |y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.quant import Int8Linear, pack_int8_for_vnni, quantize_int8

SHAPES = [(96, 576), (208, 1536), (1008, 64)]  # [out_features, in_features]
BLOCK = 32  # inputs per activation scale (csrc/quant_linear.cpp)


def activation_bound(x: torch.Tensor, deq: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[M, N]: the most that rounding x [M, K] to int8 per block of ``block`` inputs moves x @ deq.T,
    plus bfloat16's rounding (see the module docstring)."""
    m, k = x.shape
    half_step = x.float().abs().view(m, k // block, block).amax(-1) / 254  # [M, K / block]
    weight = deq.abs().view(deq.shape[0], k // block, block).sum(-1)  # [N, K / block]
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
        for rows in [1, 2, 3, 7, 8, 9, 17, 40]:  # the kernel runs 8 rows a pass: whole passes and a rest
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
    x = torch.randn(19, 1536, generator=g).bfloat16()
    whole = lin(x)
    for i in range(len(x)):
        assert torch.equal(lin(x[i : i + 1])[0], whole[i])


def test_the_packed_layout_puts_each_weight_where_the_kernel_reads_it():
    q, _ = quantize_int8(torch.randn(32, 64))
    packed = pack_int8_for_vnni(q)
    assert packed.shape == (2, 2, 8, 16, 4) and packed.dtype == torch.uint8
    for nb, g, p, lane, b in [(0, 0, 0, 0, 0), (1, 1, 7, 15, 3), (0, 1, 4, 7, 1), (1, 0, 3, 4, 2)]:
        assert int(packed[nb, g, p, lane, b]) == int(q[16 * nb + lane, 32 * g + 4 * p + b]) + 128
    with pytest.raises(ValueError, match="out_features % 16 == 0 and in_features % 32 == 0, got 40 x 64"):
        pack_int8_for_vnni(torch.zeros(40, 64, dtype=torch.int8))


def test_more_rows_run_the_dequantized_gemm():
    lin, g = _linear((96, 576))
    lin.vnni_rows = 8  # as on a CPU with AMX, with a smaller limit
    x = torch.randn(9, 576, generator=g).bfloat16()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantized().bfloat16()))


def test_not_taken_where_it_cannot_run():
    _linear((64, 64))  # skips without VNNI
    assert Int8Linear(torch.randn(64, 80).bfloat16(), None).vnni_rows == 0  # in_features % 32
    assert Int8Linear(torch.randn(40, 64).bfloat16(), None).vnni_rows == 0  # out_features % 16
    lin = Int8Linear(torch.randn(64, 64), None)  # float32 activations keep exact weight-only math
    assert lin.vnni_rows == 0
    x = torch.randn(5, 64)
    torch.testing.assert_close(lin(x), torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales))
