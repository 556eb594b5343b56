"""Synthetic arrival schedules: Poisson and gamma processes with the asked rate and burstiness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.loadgen.workload import gamma_arrivals, poisson_arrivals


def _cv(x) -> float:
    x = np.asarray(x)
    return float(x.std() / x.mean())


def test_poisson_arrivals():
    a = poisson_arrivals(4.0, 20_001, seed=7)
    assert a == poisson_arrivals(4.0, 20_001, seed=7)
    assert a != poisson_arrivals(4.0, 20_001, seed=8)
    assert a[0] == 0.0 and len(a) == 20_001
    gaps = np.diff(a)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert _cv(gaps) == pytest.approx(1.0, rel=0.10)
    assert poisson_arrivals(1.0, 0, 1) == [] and poisson_arrivals(1.0, 1, 1) == [0.0]
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            poisson_arrivals(rate, 10, 1)


@pytest.mark.parametrize("burstiness,cv", [(0.25, 2.0), (1.0, 1.0), (4.0, 0.5)])
def test_gamma_arrivals(burstiness, cv):
    a = gamma_arrivals(10.0, 20_001, burstiness, seed=3)
    assert a == gamma_arrivals(10.0, 20_001, burstiness, seed=3)
    assert a != gamma_arrivals(10.0, 20_001, burstiness, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert _cv(gaps) == pytest.approx(cv, rel=0.10)


def test_gamma_arrivals_rejects_bad_burstiness():
    for b in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError):
            gamma_arrivals(1.0, 10, b, seed=0)
