"""The int8 x int8 and int4 x int8 CPU kernels (engine/models/csrc/quant_linear.cpp) that
``Int8Linear`` and ``Int4Linear`` run for bfloat16 calls where the CPU has AVX512-VNNI: their packed
layouts, their output against the dequantized weight, row by row independent of the batch, and
where they are not taken. The kernel tests skip on CPUs without AVX512-VNNI; the layout tests run
everywhere.

Tolerance, a bound rather than a measurement: besides the weight's quantization (which the reference
shares), each input is rounded to int8 per group of 32 inputs, off by at most half a step, 1/254 of
the group's largest |x|; so output n is off by at most the sum over groups of that times the group's
sum of |w[n, k]| (``activation_bound``), plus bfloat16's rounding of the output and of the scales
the reference uses (2**-7 of |y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models import dtype, int4
from pdserve.engine.models.int4 import Int4Linear, dequantize_int4, pack_for_vnni, quantize_int4
from pdserve.engine.models.quant import Int8Linear, pack_int8_for_vnni, quantize_int8

SHAPES = [(96, 576), (208, 1536), (1008, 64)]  # [out_features, in_features]
GROUP = 32  # inputs per activation scale, and per int4 weight scale
SCHEMES = {"int8": Int8Linear, "int4": Int4Linear}


def activation_bound(x: torch.Tensor, deq: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """[M, N]: the most that rounding x [M, K] to int8 per block of ``block`` inputs moves x @ deq.T,
    plus bfloat16's rounding (see the module docstring)."""
    m, k = x.shape
    half_step = x.float().abs().view(m, k // block, block).amax(-1) / 254  # [M, K / block]
    weight = deq.abs().view(deq.shape[0], k // block, block).sum(-1)  # [N, K / block]
    return half_step @ weight.T + (x.float() @ deq.T).abs() * 2**-7 + 1e-6


def _weight(shape, seed=0) -> torch.Tensor:
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()
    w[1] *= 20  # one channel far larger: its own scales only
    return w


def _linear(scheme, shape) -> tuple[Int8Linear | Int4Linear, torch.Generator]:
    lin = SCHEMES[scheme](_weight(shape), None)
    if not lin.vnni_rows:
        pytest.skip("no AVX512-VNNI here: the linear keeps torch's kernel")
    return lin, torch.Generator().manual_seed(1)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_dequantized_weight(scheme, shape, threads):
    lin, g = _linear(scheme, shape)
    deq = lin.dequantized()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 8 rows a pass: whole passes and a rest; from 16 rows AMX tiles where the CPU has them
        for rows in [1, 2, 3, 7, 8, 9, 16, 17, 40]:
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            x[:, 3] *= 30  # an outlier input: only its own group's scale coarsens
            ref = x.float() @ deq.T
            y = lin(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
            over = (y.float() - ref).abs() - activation_bound(x, deq)
            assert over.max() <= 0, (rows, over.max().item())
            assert (y.float() - ref).abs().max() > 0  # the activations were quantized
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_row_does_not_depend_on_the_batch(scheme):
    """19 rows run on AMX tiles where the CPU has them, each row alone on AVX512-VNNI."""
    lin, g = _linear(scheme, (208, 1536))
    x = torch.randn(19, 1536, generator=g).bfloat16()
    whole = lin(x)
    for i in range(len(x)):
        assert torch.equal(lin(x[i : i + 1])[0], whole[i])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_more_rows_than_the_limit_run_the_dequantized_gemm(scheme):
    lin, g = _linear(scheme, (96, 576))
    lin.vnni_rows = lin.kernel_rows = 8  # as on a CPU with AMX, with a smaller limit
    x = torch.randn(9, 576, generator=g).bfloat16()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantized().bfloat16()))


def test_the_row_limit_holds_only_where_amx_makes_the_dense_gemm_faster(monkeypatch):
    monkeypatch.setattr(dtype, "cpu_flags", lambda: {"avx512_vnni", "amx_bf16"})
    assert int4.vnni_max_rows() == int4.AMX_VNNI_MAX_ROWS
    monkeypatch.setattr(dtype, "cpu_flags", lambda: {"avx512_vnni", "avx512_bf16"})
    assert int4.vnni_max_rows() > 1_000_000


def test_the_int8_layout_puts_each_weight_where_the_kernel_reads_it():
    q, _ = quantize_int8(torch.randn(32, 64))
    packed = pack_int8_for_vnni(q)
    assert packed.shape == (2, 2, 8, 16, 4) and packed.dtype == torch.uint8
    for nb, g, p, lane, b in [(0, 0, 0, 0, 0), (1, 1, 7, 15, 3), (0, 1, 4, 7, 1), (1, 0, 3, 4, 2)]:
        assert int(packed[nb, g, p, lane, b]) == int(q[16 * nb + lane, 32 * g + 4 * p + b]) + 128
    with pytest.raises(ValueError, match="out_features % 16 == 0 and in_features % 32 == 0, got 40 x 64"):
        pack_int8_for_vnni(torch.zeros(40, 64, dtype=torch.int8))


def test_the_int4_layout_puts_each_weight_where_the_kernel_reads_it():
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    sz = torch.randn(k // GROUP, n, 2).bfloat16()
    packed, psz = pack_for_vnni(q, sz)
    assert packed.shape == (n // 16, k // GROUP, 4, 16, 4) and packed.dtype == torch.uint8
    for nb, g, p, lane, b in [(0, 0, 0, 0, 0), (1, 1, 3, 15, 3), (0, 1, 2, 7, 1), (1, 0, 1, 4, 2)]:
        byte = int(packed[nb, g, p, lane, b])
        row = 16 * nb + lane
        assert byte & 15 == q[row, 32 * g + 4 * p + b] and byte >> 4 == q[row, 32 * g + 16 + 4 * p + b]
    assert torch.equal(psz[1, 0, 0], sz[0, 16:32, 0]) and torch.equal(psz[0, 1, 1], sz[1, :16, 1])
    with pytest.raises(ValueError, match="out_features % 16 == 0 and in_features % 32 == 0, got 40 x 64"):
        pack_for_vnni(torch.zeros(40, 64, dtype=torch.int32), torch.zeros(2, 40, 2))


def test_int4_keeps_one_packed_copy_of_the_weight_it_quantized():
    lin, _ = _linear("int4", (96, 576))
    q, sz = quantize_int4(_weight((96, 576)), GROUP, torch.bfloat16)
    packed, psz = pack_for_vnni(q, sz)
    assert torch.equal(lin.packed, packed) and torch.equal(lin._vnni.scales, psz)
    assert lin.nibbles is None  # half a byte per weight: the dequantized GEMM reads the packed copy
    assert torch.equal(lin.dequantized(), dequantize_int4(q, sz))


def test_not_taken_where_it_cannot_run():
    _linear("int8", (64, 64))  # skips without VNNI
    assert Int8Linear(torch.randn(64, 80).bfloat16(), None).vnni_rows == 0  # in_features % 32
    assert Int8Linear(torch.randn(40, 64).bfloat16(), None).vnni_rows == 0  # out_features % 16
    assert Int4Linear(torch.randn(64, 64).bfloat16(), None, group_size=64).vnni_rows == 0
    x = torch.randn(5, 64)
    lin8 = Int8Linear(torch.randn(64, 64), None)  # float32 activations keep exact weight-only math
    assert lin8.vnni_rows == 0
    torch.testing.assert_close(lin8(x), torch.ops.aten._weight_int8pack_mm(x, lin8.qweight, lin8.scales))
    lin4 = Int4Linear(torch.randn(64, 64), None)
    assert lin4.vnni_rows == 0
    torch.testing.assert_close(lin4(x), x @ lin4.dequantized().T, rtol=1e-4, atol=1e-4)
