"""Starting a local Ray instance: a start that times out is cleaned up and tried again."""

from __future__ import annotations

import subprocess

import psutil
import pytest
import ray

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


def test_an_address_where_nothing_listens_fails_at_once():
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"cannot reach a Ray cluster at 127.0.0.1:{port}"):
        launch.check_ray_address(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < launch.RAY_CONNECT_TIMEOUT_S


def test_a_grpc_server_passes_a_silent_listener_fails_and_bad_forms_are_refused():
    import socket
    import time
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # a GCS, as far as the handshake goes
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        launch.check_ray_address(f"127.0.0.1:{port}")
        launch.check_ray_address(f"ray://127.0.0.1:{port}")
    finally:
        server.stop(0)
    with socket.socket() as s:  # accepts the TCP connection, never answers: ray.init would wait for ever
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"accepts connections but does not answer as a Ray cluster"):
            launch.check_ray_address(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=1.0)
        assert time.monotonic() - t0 < 10
    launch.check_ray_address("auto")  # Ray finds it itself
    for bad in ("127.0.0.1", "127.0.0.1:port", ":6379", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="expected host:port"):
            launch.check_ray_address(bad)


def test_a_local_node_takes_the_loopback_ip_and_ray_is_left_as_it_was(monkeypatch):
    """Inside ``ray.init`` Ray picks the new node's IP, by which its processes bind their servers
    (tests/integration/test_ray_cluster.py checks the sockets of a real start)."""
    from ray._private import ray_constants, services

    if ray.is_initialized():  # a node's IP is its own, whatever the setting
        pytest.skip("Ray is already initialized in this process")
    seen = []
    monkeypatch.setattr(launch.ray, "init", lambda **kwargs: seen.append(services.get_node_ip_address()))
    setting = ray_constants.ENABLE_RAY_CLUSTER
    launch._start_local_ray(2)
    assert seen == [launch.LOOPBACK]
    assert setting == ray_constants.ENABLE_RAY_CLUSTER
