"""``--quantization``: parsed into EngineConfig by every command that takes the engine flags, and a bad
value refused with one line naming the choices."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.worker.flags import add_engine_args, engine_config_from_args


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv), device="cpu")


@pytest.mark.parametrize("value", ["none", "int8", "int4"])
def test_the_flag_reaches_the_engine_config(value):
    assert _parse(["--quantization", value]).quantization == value


def test_it_defaults_to_none():
    assert _parse([]).quantization == "none"


@pytest.mark.parametrize("command", ["serve", "throughput"])
def test_a_bad_value_gets_one_clear_line(command):
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", command, "--quantization", "int3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    line = run.stderr.strip().splitlines()[-1]
    assert f"pdserve {command}: error: argument --quantization: invalid choice: 'int3'" in line
    assert all(choice in line for choice in ("none", "int8", "int4")) and "Traceback" not in run.stderr


def test_the_worker_entry_point_refuses_it_too():
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.prefill_worker", "--quantization", "int3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "invalid choice: 'int3'" in run.stderr and "Traceback" not in run.stderr
