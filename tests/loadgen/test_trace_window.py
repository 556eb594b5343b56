"""Cutting a trace to a window, scaling it to a rate and sampling its rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.loadgen.workload import TraceRow, sample_rows, scale_to_rate, window

DATASET = "azure_llm_trace_2023"  # the datasets_dir fixture (conftest.py) skips when it is absent


def test_window_keeps_relative_schedule(conv):
    w = window(conv, start_s=600.0, duration_s=20.0)
    expected = [r for r in conv if 600.0 <= r.t_s < 620.0]
    assert len(w) == len(expected) > 50
    assert w[0].t_s == 0.0
    for got, want in zip(w, expected):
        assert got.t_s == pytest.approx(want.t_s - expected[0].t_s, abs=1e-9)
        assert (got.input_tokens, got.output_tokens) == (want.input_tokens, want.output_tokens)
    assert window(conv, 600.0, 20.0, max_requests=10) == w[:10]
    assert window(conv, max_requests=3) == conv[:3]
    assert window(conv, start_s=1e6) == []
    with pytest.raises(ValueError):
        window(conv, duration_s=-1.0)


def test_window_bounds_are_half_open():
    rows = [TraceRow(float(t), t, 1) for t in range(1, 10)]  # t = 1 .. 9
    assert [r.input_tokens for r in window(rows, 3.0, 4.0)] == [3, 4, 5, 6]
    assert [r.t_s for r in window(rows, 3.0, 4.0)] == [0.0, 1.0, 2.0, 3.0]


def test_scale_to_rate_hits_target_and_keeps_spacing(conv):
    w = window(conv, start_s=1200.0, duration_s=30.0)
    for target in (0.5, 20.0, 123.4):
        s = scale_to_rate(w, target)
        assert (len(s) - 1) / (s[-1].t_s - s[0].t_s) == pytest.approx(target, rel=1e-6)
        gaps, new = np.diff([r.t_s for r in w]), np.diff([r.t_s for r in s])
        factor = new.sum() / gaps.sum()
        np.testing.assert_allclose(new, gaps * factor, rtol=1e-9, atol=1e-12)
        assert [(r.input_tokens, r.output_tokens) for r in s] == [(r.input_tokens, r.output_tokens) for r in w]
    slower = scale_to_rate(w, 1.0)
    assert slower[-1].t_s == pytest.approx(len(w) - 1)  # rate 1: n-1 seconds from first to last


@pytest.mark.parametrize(
    "rows,rate",
    [
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], 0.0),
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], -2.0),
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], math.inf),
        ([TraceRow(0.0, 1, 1)], 1.0),
        ([TraceRow(2.0, 1, 1), TraceRow(2.0, 1, 1)], 1.0),
    ],
)
def test_scale_to_rate_rejects(rows, rate):
    with pytest.raises(ValueError):
        scale_to_rate(rows, rate)


def test_sample_rows(conv):
    a = sample_rows(conv, 500, seed=1)
    assert a == sample_rows(conv, 500, seed=1) != sample_rows(conv, 500, seed=2)
    assert len(a) == 500 and set(a) <= set(conv)
    with pytest.raises(ValueError):
        sample_rows([], 3, seed=0)
