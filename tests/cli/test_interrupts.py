"""What the pdserve command does when a user stops it early or its router never answers: Ctrl-C
while ``serve`` starts its cluster, ``generate`` against a port that accepts and stays silent."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_against_a_port_that_never_answers_names_the_timeout():
    with socket.socket() as silent:  # the kernel completes the TCP handshake; nothing ever replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        where = f"127.0.0.1:{silent.getsockname()[1]}"
        argv = PDSERVE + ["generate", "hi", "--router", where, "--timeout", "2"]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert f"the call to {where} did not finish within --timeout 2 s (DEADLINE_EXCEEDED)" in run.stderr, run.stderr


def _ignore_sigint() -> None:  # as a shell starts `pdserve serve &` in a script
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("delay_s", [2.0, 5.0])  # inside ray.init, then while the workers start
def test_ctrl_c_while_the_cluster_starts_stops_it_and_leaves_nothing(delay_s):
    import psutil

    port = _free_port()
    serve = subprocess.Popen(
        PDSERVE + ["serve", "--port", str(port), "--http-port", "0", "--model", "embedded:tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint,
        start_new_session=True,
    )
    time.sleep(delay_s)
    spawned = psutil.Process(serve.pid).children(recursive=True)
    serve.send_signal(signal.SIGINT)
    try:
        out, _ = serve.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        serve.kill()
        pytest.fail("pdserve serve did not stop within 60 s of a Ctrl-C during its start")
    if "serving on" in out:  # started before the signal (a fast machine): the normal stop
        assert serve.returncode == 0, out
    else:
        assert serve.returncode == 130 and out.rstrip().endswith("interrupted"), out
    _, alive = psutil.wait_procs(spawned, timeout=15)
    assert not alive, [p.name() for p in alive]
