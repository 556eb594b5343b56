"""The install puts everything under the one import namespace ``pdserve``.

A top-level ``proto`` (or ``engine``, ``router``, ...) in site-packages would clash with other
distributions; proto-plus, for one, installs the top-level module ``proto``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.test_layering import ALL_FOLDERS

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ALL_FOLDERS  # every folder that installs under the namespace (tests/test_layering.py)
# Package data that must travel with the code (pyproject.toml [tool.setuptools.package-data]).
DATA_FILES = (
    "pdserve/v1/generate.proto",
    "pdserve/v1/worker.proto",
    "pdserve/v1/generate_pb2.pyi",
    "pdserve/v1/worker_pb2.pyi",
    "pdserve/engine/models/embedded_corpus.txt",
    "pdserve/cli/demo_prompts.json",
)


def installed_path(p: Path) -> str:
    """Where a checkout file lands: ``engine/x.py`` -> ``pdserve/engine/x.py``; the API's
    ``proto/pdserve/v1/x.py`` -> ``pdserve/v1/x.py``."""
    parts = p.relative_to(ROOT).parts
    return PurePosixPath(*(parts[1:] if parts[:2] == ("proto", "pdserve") else ("pdserve", *parts))).as_posix()


def checkout_packages() -> set[str]:
    """The installed ``__init__.py`` of every package folder of the checkout."""
    return {
        installed_path(p)
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def stray_entries(names: list[str], dist_info: str) -> list[str]:
    """Installed paths that are neither under ``pdserve/`` nor the dist-info nor the console script."""
    bad = []
    for name in names:
        parts = PurePosixPath(name).parts
        if parts[0] in ("pdserve", dist_info):
            continue
        if parts[0] == ".." and parts[-1] in ("pdserve", "pdserve.exe"):  # bin/pdserve
            continue
        bad.append(name)
    return bad


def check_layout(names: list[str], dist_info: str) -> None:
    assert not stray_entries(names, dist_info), "installed outside the pdserve namespace"
    present = set(names)
    missing = sorted((checkout_packages() | set(DATA_FILES)) - present)
    assert not missing, f"not installed (add to pyproject.toml packages / package-data): {missing}"


def installed_distribution() -> importlib.metadata.Distribution:
    """The installed pdserve, not the ``pdserve.egg-info`` that a build leaves in the checkout."""
    paths = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    found = list(importlib.metadata.distributions(name="pdserve", path=paths))
    assert found, "pdserve is not installed"
    return found[0]


def is_editable(dist: importlib.metadata.Distribution) -> bool:
    text = dist.read_text("direct_url.json")
    return bool(text and json.loads(text).get("dir_info", {}).get("editable"))


def setuptools_usable() -> bool:
    """A setuptools new enough for pyproject.toml's build-system (>= 68) is importable."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    major = importlib.metadata.version("setuptools").split(".")[0]
    return major.isdigit() and int(major) >= 68


def test_stray_entries_sees_top_level_modules() -> None:
    names = [
        "pdserve/engine/config.py",
        "pdserve-0.1.0.dist-info/RECORD",
        "../../../bin/pdserve",
        "proto/__init__.py",
        "engine/config.py",
        "../../../bin/other",
    ]
    assert stray_entries(names, "pdserve-0.1.0.dist-info") == [
        "proto/__init__.py",
        "engine/config.py",
        "../../../bin/other",
    ]


def test_installed_distribution_has_only_the_pdserve_namespace(tmp_path: Path) -> None:
    dist = installed_distribution()
    if not is_editable(dist):
        names = [PurePosixPath(f).as_posix() for f in dist.files or []]
        dist_info = next(PurePosixPath(n).parts[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        check_layout(names, dist_info)
        return
    # An editable install holds only import hooks: check what a normal install would hold instead.
    if not setuptools_usable():
        pytest.skip("editable install and no setuptools>=68 here to build a wheel with")
    src = tmp_path / "src"  # a clean copy, so no build/ or egg-info lands in the checkout
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = out.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    check_layout(names, dist_info)
    assert "pdserve = pdserve.cli.main:main" in entry_points


def test_proto_plus_and_pdserve_import_side_by_side(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("proto-plus")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("proto-plus is not installed (test extra)")
    # Not from the repo root: there the checkout's proto/ folder would shadow proto-plus.
    code = (
        "import proto; proto.Message; import pdserve.v1.generate_pb2; import pdserve.engine.config; "
        "print(proto.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # proto-plus's own package, not the checkout's proto/ folder (a venv may live inside the checkout)
    assert Path(out.stdout.strip()).resolve().parent != (ROOT / "proto").resolve(), "proto resolved to the checkout"
