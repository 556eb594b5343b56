"""A KV cache past this machine's memory is refused in one line, before anything starts (serve:
before Ray; throughput: when the cache is allocated)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["throughput", "--kv-cache-gib", "100000"], "GiB) does not fit in memory here; lower --kv-cache-gib"),
        (["serve", "--kv-cache-gib", "100000", "--port", "0"], "2 workers would hold 200000 GiB of KV cache"),
    ],
)
def test_a_kv_cache_past_the_machine_is_one_line(argv, needle):
    run = subprocess.run(PDSERVE + argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert needle in run.stderr and "Traceback" not in run.stderr
