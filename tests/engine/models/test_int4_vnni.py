"""The int4 x int8 CPU kernel (engine/models/csrc/quant_linear.cpp) that ``Int4Linear`` runs for
bfloat16 calls of up to ``vnni_max_rows()`` rows where the CPU has AVX512-VNNI: its packed layout,
its output against the dequantized weight, row by row independent of the batch, and where it is not
taken. The kernel tests skip on CPUs without AVX512-VNNI; the layout test runs everywhere.

Tolerance, a bound rather than a measurement (``activation_bound`` of test_int8_vnni.py with blocks
of 32 inputs): besides the weight's quantization, which the reference shares, each input is rounded
to int8 per group of 32 inputs, off by at most half a step, 1/254 of the group's largest |x|; plus
bfloat16's rounding of the output (2**-7 of |y|).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.int4 import Int4Linear, pack_for_vnni, quantize_int4
from tests.engine.models.test_int8_vnni import activation_bound

SHAPES = [(96, 576), (208, 1536), (3072, 64)]  # [out_features, in_features]
GROUP = 32  # inputs per weight scale and per activation scale


def _linear(shape, seed=0) -> tuple[Int4Linear, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    w[1] *= 20  # one channel far larger: its own scales only
    lin = Int4Linear(w, None)
    if not lin.vnni_rows:
        pytest.skip("no AVX512-VNNI here: Int4Linear keeps torch's kernel")
    return lin, g


def test_the_packed_layout_puts_each_weight_where_the_kernel_reads_it():
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


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_dequantized_weight(shape, threads):
    lin, g = _linear(shape)
    deq = lin.dequantized()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [1, 2, 3, 7, 8, 9, 17, 40]:  # the kernel runs 8 rows a pass: whole passes and a rest
            x = torch.randn(rows, shape[1], generator=g).bfloat16()
            x[:, 3] *= 30  # an outlier input: only its own group's scale coarsens
            ref = x.float() @ deq.T
            y = lin(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
            over = (y.float() - ref).abs() - activation_bound(x, deq, GROUP)
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


def test_more_rows_run_the_dequantized_gemm():
    lin, g = _linear((96, 576))
    lin.vnni_rows = lin.kernel_rows = 8  # as on a CPU with AMX, with a smaller limit
    x = torch.randn(9, 576, generator=g).bfloat16()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.dequantized().bfloat16()))


def test_the_weight_is_quantized_as_torch_path_quantizes_it():
    lin, _ = _linear((96, 576))
    w = (torch.randn(96, 576, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    w[1] *= 20
    q, sz = quantize_int4(w, GROUP, torch.bfloat16)
    packed, psz = pack_for_vnni(q, sz)
    assert torch.equal(lin.packed, packed) and torch.equal(lin._vnni.scales, psz)


def test_not_taken_where_it_cannot_run():
    _linear((64, 64))  # skips without VNNI
    assert Int4Linear(torch.randn(64, 64), None).vnni_rows == 0  # float32 activations keep torch's kernel
    assert Int4Linear(torch.randn(64, 64).bfloat16(), None, group_size=64).vnni_rows == 0
    lin = Int4Linear(torch.randn(64, 64), None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ lin.dequantized().T, rtol=1e-4, atol=1e-4)


def test_the_row_limit_holds_only_where_amx_makes_the_dense_gemm_faster(monkeypatch):
    from pdserve.engine.models import int4

    monkeypatch.setattr(int4, "cpu_flags", lambda: {"avx512_vnni", "amx_bf16"})
    assert int4.vnni_max_rows() == int4.AMX_VNNI_MAX_ROWS
    monkeypatch.setattr(int4, "cpu_flags", lambda: {"avx512_vnni", "avx512_bf16"})
    assert int4.vnni_max_rows() > 1_000_000
