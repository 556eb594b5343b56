"""Greedy sampling's argmax over bfloat16 CPU logits (``csrc/argmax_bf16.cpp`` through
``kernels.argmax_rows``) gives torch's ``max(dim=-1).indices``: the first index of a tie, a NaN as
the largest, -0.0 equal to +0.0, any vocabulary length (the tail lanes) and strided rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.kernels import KernelUnavailable, argmax_rows, load_cpu_kernels
from pdserve.engine.params import SamplingParams
from pdserve.engine.sampling import sample


def _kernels() -> bool:
    try:
        load_cpu_kernels()
    except KernelUnavailable:
        return False
    return True


pytestmark = pytest.mark.skipif(not _kernels(), reason="no C++ kernels here")


def _torch(x: torch.Tensor) -> list[int]:
    return x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (2, 16), (4, 17), (32, 49152), (2, 262144)])
def test_random_rows_of_any_length(rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(torch.bfloat16)
    assert argmax_rows(x) == _torch(x)


def test_ties_take_the_first_index():
    x = torch.randint(-3, 3, (64, 100), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = argmax_rows(x)
    assert got == _torch(x)
    assert all(x[r, : got[r]].max() < x[r, got[r]] for r in range(64) if got[r])  # no earlier equal value


def test_nan_inf_and_signed_zeros_as_torch_orders_them():
    x = torch.full((5, 40), -1.0, dtype=torch.bfloat16)
    x[0, 33] = 2.0
    x[1, 7], x[1, 20], x[1, 30] = float("nan"), float("nan"), float("inf")  # NaN wins, the first one
    x[2] = float("-inf")  # nothing above -inf: index 0
    x[3, 3], x[3, 9] = -0.0, 0.0  # equal: the first
    x[4, 39] = float("inf")  # in the tail lanes past the last full vector of 16
    assert argmax_rows(x) == _torch(x) == [33, 7, 0, 3, 39]


def test_strided_rows_and_other_logits():
    base = torch.randn(6, 80, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    view = base[::2, 5:70]  # row stride 160 elements, 65 columns
    assert argmax_rows(view) == _torch(view)
    assert argmax_rows(base.float()) is None  # float32: torch's max
    assert argmax_rows(base.t()) is None  # not contiguous along the vocabulary


def test_sample_takes_it_for_greedy_rows_only():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0)]
    tokens = sample(x, params, [0, 0, 0])
    assert tokens[0] == _torch(x)[0] and tokens[2] == _torch(x)[2]
