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
GUARD = (
    "import os, runpy, sys; sys.argv = sys.argv[1:]; code = 0\n"
    "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "mods = [m for m in sys.modules if m.split('.')[0] == 'pdserve']\n"
    "bad = [m for m in mods if getattr(sys.modules[m], '__file__', None) and not "
    "sys.modules[m].__file__.startswith(os.getcwd())]\n"
    "print('PDSERVE_MODULES', sorted(mods), 'FOREIGN', bad, file=sys.stderr); sys.exit(code)"
)


def documented_steps() -> list[str]:
    """The shell lines of the first code block under docs/api.md's "### Calling pdserve from your own program"."""
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = doc[doc.index("### Calling pdserve from your own program") :]
    block = section[section.index("```bash\n") + len("```bash\n") : section.index("\n```", section.index("```bash"))]
    return [line.split("#", 1)[0].strip() for line in block.splitlines()]


@pytest.fixture(scope="module")
def client_dir(tmp_path_factory) -> Path:
    """The steps of docs/api.md ("Calling pdserve from your own program"), literally: the .proto
    files copied to ``protos/``, the example beside them, stubs compiled there with grpcio-tools,
    their package made regular."""
    pytest.importorskip("grpc_tools")
    root = tmp_path_factory.mktemp("client")
    src = root / "protos" / "pdserve" / "v1"
    src.mkdir(parents=True)
    for f in importlib.resources.files("pdserve.v1").iterdir():  # the installed copies of proto/pdserve/v1
        if f.name.endswith(".proto"):
            shutil.copyfile(f, src / f.name)
    shutil.copyfile(ROOT / "examples" / "grpc_client.py", root / "grpc_client.py")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        "protos",
        "--python_out=.",
        "--grpc_python_out=.",
        "protos/pdserve/v1/generate.proto",
    ]
    steps = documented_steps()
    assert " ".join(["python", *cmd[1:]]) in steps, "docs/api.md's protoc line differs from the one run here"
    assert "touch pdserve/__init__.py pdserve/v1/__init__.py" in steps
    subprocess.run(cmd, check=True, cwd=root)
    (root / "pdserve" / "__init__.py").touch()
    (root / "pdserve" / "v1" / "__init__.py").touch()
    return root


def run_example(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``python grpc_client.py ARGS`` in ``root`` (through a guard that lists where pdserve modules came from)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", GUARD, "grpc_client.py", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )


async def test_example_client_streams_with_only_generated_stubs(client_dir, embedded_dir):
    async with local_pipeline(embedded_dir, "split") as pipe:
        async with Client(pipe.address) as client:
            ref = await client.generate(make_request("Once upon a time", max_tokens=20, temperature=0))
        done = await asyncio.to_thread(
            run_example, client_dir, "Once upon a time", "--address", pipe.address, "--max-tokens", "20"
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == ref.text + "\n"
        assert "FINISH_REASON_LENGTH" in done.stderr and "FOREIGN []" in done.stderr
        assert "'pdserve.v1.generate_pb2'" in done.stderr
        refused = await asyncio.to_thread(run_example, client_dir, "", "--address", pipe.address)
        assert refused.returncode == 2 and "INVALID_ARGUMENT" in refused.stderr
        assert await pipe.wait_idle() == 0


async def test_example_client_sends_an_api_key(client_dir, embedded_dir):
    async with local_pipeline(embedded_dir, "split", api_keys=("k-123",)) as pipe:
        args = ("hi", "--address", pipe.address, "--max-tokens", "3")
        missing = await asyncio.to_thread(run_example, client_dir, *args)
        assert missing.returncode == 2 and "UNAUTHENTICATED" in missing.stderr
        ok = await asyncio.to_thread(run_example, client_dir, *args, "--api-key", "k-123")
        assert ok.returncode == 0, ok.stderr
