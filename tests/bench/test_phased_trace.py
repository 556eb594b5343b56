"""benchmarks/phased_trace.py: its phases alternate as declared and the file reads back as a trace."""

from __future__ import annotations

import pytest

from pdserve.loadgen.azure import read_azure_trace
from tests.bench._scripts import load_script

T = load_script("phased_trace")
PHASES, phased_trace, write_phased_trace = T.PHASES, T.phased_trace, T.write_phased_trace


def test_phases_alternate_with_their_lengths_and_even_counts():
    rows = phased_trace(10, rounds=2, seed=1)
    kinds = [(p, o) for _, p, o in rows]
    expected = [PHASES[i % 2][1:] for i in range(4) for _ in range(3 if i < 2 else 2)]
    assert kinds == expected
    times = [t for t, _, _ in rows]
    assert times == sorted(times) and times[0] > 0


def test_the_file_reads_back_as_an_azure_trace(tmp_path):
    path = write_phased_trace(tmp_path / "phases.csv", 8, rounds=2, seed=3)
    back = read_azure_trace(path)
    rows = phased_trace(8, rounds=2, seed=3)
    assert [(p, o) for _, p, o in back] == [(p, o) for _, p, o in rows]
    assert [t for t, _, _ in back] == pytest.approx([t - rows[0][0] for t, _, _ in rows], abs=1e-6)


def test_too_few_requests_for_the_phases_is_an_error():
    with pytest.raises(ValueError, match="at least 4 requests"):
        phased_trace(3)
