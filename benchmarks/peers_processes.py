"""Processes of ``benchmarks/peers.py``: servers and clients started in their own process groups, with
their output in log files, and stopped with everything they started; the load other work puts on
the machine meanwhile. Standard library only."""

from __future__ import annotations

import math
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

_children: list[subprocess.Popen] = []


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so it and its children form one process group) with
    stdout+stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"$ {shlex.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    _children.append(proc)
    return proc


def _killpg(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT (a server's own clean shutdown), then SIGTERM, then SIGKILL to its whole group."""
    if proc.poll() is None:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if sig == signal.SIGINT:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    break
            else:
                _killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    # whatever the leader left behind in its group (e.g. an engine process)
    if _killpg(proc.pid, signal.SIGTERM):
        time.sleep(1.0)
        _killpg(proc.pid, signal.SIGKILL)
    if proc in _children:
        _children.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(_children)):
        stop(proc, grace_s=15.0)


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> int:
    """Run to completion (or ``timeout_s``: then stopped, returns 124); output appended to ``log``."""
    proc = spawn(cmd, log, env)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with open(log, "a") as f:
            f.write(f"\n[peers] timed out after {timeout_s:.0f}s; stopped\n")
        return 124
    finally:
        stop(proc)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_busy_s() -> float:
    """CPU-seconds every core of the machine has spent busy since boot (from /proc/stat); nan where unknown."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return math.nan


def _own_children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def busy_cores(seconds: float = 1.0) -> float:
    """Cores in use on the whole machine over the next ``seconds`` (anything: other users included)."""
    b0 = _cpu_busy_s()
    time.sleep(seconds)
    return (_cpu_busy_s() - b0) / seconds


class OtherLoad:
    """Cores used by processes that are not ours (nor our children's) while the block runs."""

    def __enter__(self):
        self.t, self.busy, self.own = time.monotonic(), _cpu_busy_s(), _own_children_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.t
        other = (_cpu_busy_s() - self.busy) - (_own_children_cpu_s() - self.own)
        self.cores = max(0.0, other / wall) if wall > 0 else math.nan
        return False


def _process_kind(pid: str) -> str:
    """A name for what process ``pid`` is: a Ray actor's class (``ray::RouterActor``), "ray services"
    for Ray's own daemons, the module a ``python -m`` runs, else the command name."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    argv = [a.decode(errors="replace") for a in argv if a]
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    name = argv[0].split()[0] if argv else ""
    if name.startswith("ray::") and not name.endswith("Agent"):
        return name
    if name.startswith("ray::") or comm in ("gcs_server", "raylet") or any("/ray/" in a for a in argv[:3]):
        return "ray services"
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return comm


def session_cpu_s(sid: int) -> dict[str, float]:
    """CPU seconds (user + system, clock-tick resolution) each live process of session ``sid`` has
    used since it started, summed by :func:`_process_kind`. A server started by :func:`spawn` leads
    its own session, so ``sid`` is its pid and every process it starts (Ray's included) is counted."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # after the command name: state ppid pgrp session ...
                continue
            kind = _process_kind(d.name)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out
