"""worker/cpus.py's pinning of one thread for a measurement: the calling thread (and a thread it
starts meanwhile) runs on the given core only, and its own mask comes back afterwards."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.worker.cpus import pinned_thread, worker_cpu


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_pinned_block_runs_on_one_core_and_gives_the_mask_back():
    before = os.sched_getaffinity(0)
    cpu = min(before)
    seen = []
    with pinned_thread([cpu]):
        assert os.sched_getaffinity(0) == {cpu}
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
    assert seen == [{cpu}]
    assert os.sched_getaffinity(0) == before


def test_only_a_one_thread_cpu_worker_is_pinned():
    assert worker_cpu("cpu", 2) is None and worker_cpu("cuda", 1) is None and worker_cpu("cpu", None) is None
    if hasattr(os, "sched_setaffinity"):
        assert worker_cpu("cpu", 1) == min(os.sched_getaffinity(0))
