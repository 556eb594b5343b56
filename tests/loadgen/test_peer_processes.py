"""benchmarks/peers_processes.py: the CPU a server's session used, counted by process kind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench._scripts import load_script

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\ntime.sleep(30)\n"


def _peers_processes():
    return load_script("peers_processes")


def test_a_session_leader_and_its_children_are_counted_by_kind(tmp_path):
    """A leader that burns 0.3 s and starts a ``python -m`` child burning 0.6 s: both counted under
    their own names, nothing from outside the session."""
    pp = _peers_processes()
    (tmp_path / "burner.py").write_text(BURN.format(s=0.6))
    leader = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-m', 'burner'], cwd={str(tmp_path)!r})\n" + BURN.format(s=0.3)
    )
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cpu = pp.session_cpu_s(proc.pid)
            if cpu.get("burner", 0) >= 0.6 and sum(cpu.values()) >= 0.9:
                break
            time.sleep(0.1)
        assert set(cpu) == {"burner", Path(sys.executable).name[:15]}
        assert 0.6 <= cpu["burner"] < 1.0
        assert 0.3 <= cpu[Path(sys.executable).name[:15]] < 1.0
        assert pp.session_cpu_s(os.getsid(0)).get("burner") is None  # another session: not counted
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
