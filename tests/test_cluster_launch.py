"""Starting a local Ray instance: a start that times out is cleaned up and tried again."""

from __future__ import annotations

import subprocess

import psutil
import pytest

from pdserve.cluster import launch


class _FlakyInit:
    """Stands in for ``ray.init``: the first ``failures`` calls spawn a child (as Ray spawns its
    GCS and raylet) and raise what Ray raises when the raylet misses its 30 s."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0
        self.spawned: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            self.spawned.append(subprocess.Popen(["sleep", "60"]))
            raise Exception("The current node timed out during startup.")


def test_a_timed_out_start_is_killed_and_tried_again(monkeypatch):
    init = _FlakyInit(failures=1)
    monkeypatch.setattr(launch.ray, "init", init)
    monkeypatch.setattr(launch.ray, "shutdown", lambda: None)
    bystander = subprocess.Popen(["sleep", "60"])  # a child from before the start: left alone
    try:
        launch._start_local_ray(2)
        assert init.calls == 2
        assert not psutil.pid_exists(init.spawned[0].pid)  # killed and reaped, not left beside the new start
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_start_that_keeps_failing_raises_the_last_error(monkeypatch):
    init = _FlakyInit(failures=launch.RAY_START_ATTEMPTS)
    monkeypatch.setattr(launch.ray, "init", init)
    monkeypatch.setattr(launch.ray, "shutdown", lambda: None)
    with pytest.raises(Exception, match="timed out during startup"):
        launch._start_local_ray(2)
    assert init.calls == launch.RAY_START_ATTEMPTS
    assert not [p.pid for p in init.spawned if psutil.pid_exists(p.pid)]


def test_bad_arguments_are_not_retried(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("num_cpus must be positive")

    monkeypatch.setattr(launch.ray, "init", init)
    with pytest.raises(ValueError):
        launch._start_local_ray(0)
    assert len(calls) == 1
