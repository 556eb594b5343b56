"""A small soak on a real local Ray cluster: a trace's arrivals, client cancels, tight deadlines and
one decode-worker kill; nothing hangs, no KV block leaks, no token is wrong."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_small_soak_with_a_decode_worker_kill():
    from pdserve.soak.trace_soak import run_soak, summary_lines

    s = run_soak("embedded", num_requests=100, rate=10.0, kills=("decode",), seed=1)
    report = "\n".join(summary_lines(s))
    assert s["hung"] == 0, report
    assert not any(s["used_blocks"].values()), report
    assert s["mismatches"] == 0, report
    assert s["by_action"]["normal"] == {"completed": s["actions"]["normal"]}, report  # every plain request ended well
    assert s["recoveries"][0][1] < 30, report


def test_overload_phase_refuses_at_once_and_completes_the_rest():
    """Twice the measured capacity of 2 + 2 workers, each decode worker bounded to 4 requests: the
    requests past the bound are refused at once (RESOURCE_EXHAUSTED), every other one completes
    with the right tokens; nothing hangs and no KV block stays used."""
    from pdserve.soak.overload import overload_lines, overload_ok, run_overload

    s = run_overload("embedded", seconds=8.0, factor=2.0, max_requests_per_worker=4, seed=2)
    report = "\n".join(overload_lines(s))
    assert overload_ok(s), report
    assert s["outcomes"]["completed"] > 0 and s["outcomes"]["RESOURCE_EXHAUSTED"] > 0, report
    assert s["refusal_max_s"] < 15.0, report  # no refused request waited for capacity (2 cores, saturated)
