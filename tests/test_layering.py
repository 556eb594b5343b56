"""The import layers (docs/architecture.md, "Layout") and the file-size limit, checked with ``ast``
over the source tree; test_layering_checker.py tries the checker itself on throwaway trees.

The checkout's top-level folders install as ``pdserve.<folder>`` (pyproject.toml ``package-dir``), so
``engine/config.py`` is the module ``pdserve.engine.config`` and our code imports it by that name.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "pdserve"
PACKAGES = (
    "proto",
    "engine",
    "rpc",
    "worker",
    "prefill_worker",
    "decode_worker",
    "colocated_worker",
    "switchable_worker",
    "router",
    "cluster",
    "loadgen",
    "planner",
    "soak",
    "cli",
)
ALL_FOLDERS = PACKAGES  # every folder that installs under the namespace
ROLES = ("prefill_worker", "decode_worker", "colocated_worker")
# Which of our folders each folder may import (``v1``: the generated gRPC stubs). Each folder imports
# only folders listed before it here, so the folders form layers and no import goes round in a circle.
MAY_IMPORT = {
    "engine": set(),
    "rpc": set(),
    "worker": {"engine", "rpc", "v1"},
    **{role: {"engine", "rpc", "v1", "worker"} for role in ROLES},
    "switchable_worker": {"engine", "rpc", "v1", "worker", "prefill_worker", "decode_worker"},
    "router": {"engine", "rpc", "v1"},
    "cluster": {"engine", "rpc", "v1", "worker", *ROLES, "switchable_worker", "router"},
    "loadgen": {"engine", "rpc", "v1", "worker", "router"},
    "planner": {"engine", "rpc", "v1", "worker", *ROLES, "switchable_worker", "router", "loadgen"},
    "soak": {"engine", "rpc", "v1", "worker", "router", "cluster", "loadgen"},
    "cli": {
        "engine",
        "rpc",
        "v1",
        "worker",
        *ROLES,
        "switchable_worker",
        "router",
        "cluster",
        "loadgen",
        "planner",
        "soak",
    },
}
# benchmarks/ holds scripts and tests/ the tests, not packages of ours; they keep the same limit
SIZE_CHECKED = (*PACKAGES, "benchmarks", "tests")
MAX_LINES = 300


def ours(package: str) -> str:
    """The import name of one of our folders: ``engine`` -> ``pdserve.engine``."""
    return f"{NAMESPACE}.{package}"


class Import:
    """One import statement target: ``module`` is absolute; ``names`` are the from-imported names."""

    def __init__(self, path: Path, lineno: int, module: str, names: tuple[str, ...] = ()) -> None:
        self.path, self.lineno, self.module, self.names = path, lineno, module, names

    @property
    def top(self) -> str:
        """The top-level distribution the import names: ``torch``, ``ray``; ours as ``pdserve.engine``."""
        parts = self.module.split(".")
        return ".".join(parts[:2]) if parts[0] == NAMESPACE else parts[0]

    @property
    def is_ours(self) -> bool:
        return self.module.split(".")[0] == NAMESPACE

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.lineno} imports {self.module}"


def module_of(path: Path, root: Path) -> str:
    """The installed module name of a source file: ``engine/kv/codec.py`` -> ``pdserve.engine.kv.codec``,
    ``proto/pdserve/v1/x.py`` -> ``pdserve.v1.x`` (the API's stubs install as ``pdserve.v1``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[:2] == ["proto", NAMESPACE]:
        parts = parts[2:]
    return ".".join([NAMESPACE, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def imports_of(path: Path, root: Path) -> list[Import]:
    """Every import in the file, at any depth (function-level and conditional ones included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_of(path, root) if path.name == "__init__.py" else module_of(path, root).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".") if package else []
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = tuple(a.name for a in node.names)
            if base == NAMESPACE:  # `from pdserve import engine` imports the package pdserve.engine
                found += [Import(path, node.lineno, f"{base}.{n}") for n in names if n != "*"]
            else:
                found.append(Import(path, node.lineno, base, names))
    return found


def source_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_file(module: str, root: Path) -> Path | None:
    namespace, *parts = module.split(".")
    if namespace != NAMESPACE or not parts:
        return None  # not ours, or the namespace package itself (it has no file)
    for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def project_targets(imp: Import, root: Path) -> list[Path]:
    """Project files that executing ``imp`` runs: each enclosing package, the module, and submodules
    named by ``from package import submodule``."""
    parts = imp.module.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    names += [f"{imp.module}.{n}" for n in imp.names if n != "*"]
    return [f for f in (module_file(n, root) for n in names) if f is not None]


def closure(starts: list[Path], root: Path) -> dict[Path, Path | None]:
    """Project files reachable from ``starts``, each mapped to the file that first imported it."""
    parent: dict[Path, Path | None] = dict.fromkeys(starts)
    todo = deque(starts)
    while todo:
        path = todo.popleft()
        for imp in imports_of(path, root):
            if not imp.is_ours:
                continue
            for target in project_targets(imp, root):
                if target not in parent:
                    parent[target] = path
                    todo.append(target)
    return parent


def chain(path: Path, parent: dict[Path, Path | None], root: Path) -> str:
    links = []
    node: Path | None = path
    while node is not None:
        links.append(str(node.relative_to(root)))
        node = parent[node]
    return " <- ".join(links)


def forbidden_imports(package: str, forbidden: set[str], root: Path = ROOT) -> list[str]:
    return [
        imp.where(root)
        for path in source_files(root, package)
        for imp in imports_of(path, root)
        if imp.top in forbidden
    ]


def transitive_violations(package: str, forbidden: set[str], root: Path = ROOT) -> list[str]:
    parent = closure(source_files(root, package), root)
    return [
        f"{imp.where(root)} (reached via {chain(path, parent, root)})"
        for path in sorted(parent)
        for imp in imports_of(path, root)
        if imp.top in forbidden
    ]


def test_repository_root_is_found() -> None:
    assert (ROOT / "pyproject.toml").is_file()
    for package in ALL_FOLDERS:
        assert source_files(ROOT, package), f"no sources found under {package}/"


def bare_imports(paths: list[Path], root: Path) -> list[str]:
    """Imports of our folders by their checkout names (``import engine``) instead of ``pdserve.engine``."""
    return [imp.where(root) for path in paths for imp in imports_of(path, root) if imp.top in ALL_FOLDERS]


def test_our_packages_are_imported_only_under_the_namespace() -> None:
    # A bare `engine.x` works only from the repo root and would be a second copy of `pdserve.engine.x`.
    paths = [p for package in ALL_FOLDERS for p in source_files(ROOT, package)] + source_files(ROOT, "tests")
    bad = bare_imports(paths, ROOT)
    assert not bad, f"import our packages as {NAMESPACE}.<package>:\n" + "\n".join(bad)


def test_proto_imports_nothing_of_ours() -> None:
    allowed_third_party = {"grpc", "grpc_tools"}
    bad = []
    for path in source_files(ROOT, "proto"):
        for imp in imports_of(path, ROOT):
            if (
                imp.top in (ours("proto"), ours("v1"))
                or imp.top in allowed_third_party
                or imp.top in sys.stdlib_module_names
            ):
                continue
            if imp.module == "google.protobuf" or imp.module.startswith("google.protobuf."):
                continue
            bad.append(imp.where(ROOT))
    assert not bad, "proto/ may import only google.protobuf, grpc and pdserve.v1.*:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_folders_import_only_the_layers_below(package: str) -> None:
    allowed = {ours(p) for p in (*MAY_IMPORT[package], package)}
    bad = [
        imp.where(ROOT)
        for path in source_files(ROOT, package)
        for imp in imports_of(path, ROOT)
        if imp.is_ours and imp.top not in allowed
    ]
    assert not bad, f"{package}/ may import only {sorted(MAY_IMPORT[package])} of ours (MAY_IMPORT):\n" + "\n".join(bad)


def test_layers_have_no_circle() -> None:
    order = list(MAY_IMPORT)
    for package, allowed in MAY_IMPORT.items():
        later = [p for p in allowed if p in order and order.index(p) >= order.index(package)]
        assert not later, f"{package} may import {later}, listed after it: MAY_IMPORT must stay layered"


def test_engine_knows_no_grpc_and_no_ray() -> None:
    bad = forbidden_imports("engine", {"ray", "grpc", "grpc_health", "grpc_reflection", "google", ours("v1")})
    assert not bad, "engine/ is model + attention + KV + scheduling + text; serving lives above it:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", [p for p in PACKAGES if p not in ("cluster", "soak", "cli")])
def test_only_cluster_soak_and_cli_import_ray(package: str) -> None:
    bad = forbidden_imports(package, {"ray"})
    assert not bad, "only cluster/, soak/ and cli/ may import ray:\n" + "\n".join(bad)


def test_router_never_reaches_torch_transformers_or_ray() -> None:
    bad = transitive_violations("router", {"torch", "transformers", "ray"})
    assert not bad, "router/ must stay torch-free, also through what it imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", SIZE_CHECKED)
def test_source_files_stay_small(package: str) -> None:
    long = []
    for path in source_files(ROOT, package):
        if "_pb2" in path.name:
            continue  # generated
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)
