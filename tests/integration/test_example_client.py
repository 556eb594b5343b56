"""examples/grpc_client.py against a running router, with stubs compiled from the shipped .proto files."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline

ROOT = Path(__file__).resolve().parents[2]
# after the example ran: every pdserve module it imported must come from the generated stubs
GUARD = ("import runpy, sys; sys.argv = sys.argv[1:]; code = 0\n"
         "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "except SystemExit as e:\n    code = e.code\n"
         "mods = [m for m in sys.modules if m.split('.')[0] == 'pdserve']\n"
         "bad = [m for m in mods if getattr(sys.modules[m], '__file__', None) and not "
         "sys.modules[m].__file__.startswith(sys.path[0])]\n"
         "print('PDSERVE_MODULES', sorted(mods), 'FOREIGN', bad, file=sys.stderr); sys.exit(code)")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """The installed .proto files, copied to their own root and compiled there with grpcio-tools."""
    pytest.importorskip("grpc_tools")
    root = tmp_path_factory.mktemp("client")
    src = root / "protos" / "pdserve" / "v1"
    src.mkdir(parents=True)
    for f in importlib.resources.files("pdserve.v1").iterdir():
        if f.name.endswith(".proto"):
            shutil.copyfile(f, src / f.name)
    out = root / "gen"
    out.mkdir()
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root / 'protos'}", f"--python_out={out}",
           f"--grpc_python_out={out}", "pdserve/v1/generate.proto", "pdserve/v1/worker.proto"]
    subprocess.run(cmd, check=True, cwd=root)
    (out / "pdserve" / "v1" / "__init__.py").touch()  # a regular package, ahead of the installed one
    return out


def run_example(stubs: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(stubs)}
    return subprocess.run([sys.executable, "-c", GUARD, str(ROOT / "examples" / "grpc_client.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=stubs)


async def test_example_client_streams_with_only_generated_stubs(stubs, stories_dir):
    async with local_pipeline(stories_dir, "split") as pipe:
        async with Client(pipe.address) as client:
            ref = await client.generate(make_request("Once upon a time", max_tokens=20, temperature=0))
        done = await asyncio.to_thread(run_example, stubs, "Once upon a time", "--address", pipe.address,
                                       "--max-tokens", "20")
        assert done.returncode == 0, done.stderr
        assert done.stdout == ref.text + "\n"
        assert "FINISH_REASON_LENGTH" in done.stderr and "FOREIGN []" in done.stderr
        assert "'pdserve.v1.generate_pb2'" in done.stderr
        refused = await asyncio.to_thread(run_example, stubs, "", "--address", pipe.address)
        assert refused.returncode == 2 and "INVALID_ARGUMENT" in refused.stderr
        assert await pipe.wait_idle() == 0
