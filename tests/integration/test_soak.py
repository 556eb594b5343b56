"""A small soak on a real local Ray cluster: a trace's arrivals, client cancels, tight deadlines and
one decode-worker kill; nothing hangs, no KV block leaks, no token is wrong."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_small_soak_with_a_decode_worker_kill():
    from pdserve.cluster.soak import run_soak, summary_lines

    s = run_soak("embedded", num_requests=100, rate=10.0, kills=("decode",), seed=1)
    report = "\n".join(summary_lines(s))
    assert s["hung"] == 0, report
    assert not any(s["used_blocks"].values()), report
    assert s["mismatches"] == 0, report
    assert s["by_action"]["normal"] == {"completed": s["actions"]["normal"]}, report  # every plain request ended well
    assert s["recoveries"][0][1] < 30, report
