"""DESIGN.md §2 import rules and the file-size limit, checked with ``ast`` over the source tree."""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proto", "engine", "prefill_worker", "decode_worker", "router", "cluster")
MAX_LINES = 300


class Import:
    """One import statement target: ``module`` is absolute; ``names`` are the from-imported names."""

    def __init__(self, path: Path, lineno: int, module: str, names: tuple[str, ...] = ()) -> None:
        self.path, self.lineno, self.module, self.names = path, lineno, module, names

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.lineno} imports {self.module}"


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
            found.append(Import(path, node.lineno, base, tuple(a.name for a in node.names)))
    return found


def source_files(root: Path, package: str) -> list[Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_file(module: str, root: Path) -> Path | None:
    parts = module.split(".")
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
    parent: dict[Path, Path | None] = {p: None for p in starts}
    todo = deque(starts)
    while todo:
        path = todo.popleft()
        for imp in imports_of(path, root):
            if imp.top not in PACKAGES:
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
    return [imp.where(root) for path in source_files(root, package)
            for imp in imports_of(path, root) if imp.top in forbidden]


def transitive_violations(package: str, forbidden: set[str], root: Path = ROOT) -> list[str]:
    parent = closure(source_files(root, package), root)
    return [f"{imp.where(root)} (reached via {chain(path, parent, root)})"
            for path in sorted(parent) for imp in imports_of(path, root) if imp.top in forbidden]


def test_repository_root_is_found() -> None:
    assert (ROOT / "pyproject.toml").is_file()
    for package in PACKAGES:
        assert source_files(ROOT, package), f"no sources found under {package}/"


def test_proto_imports_nothing_of_ours() -> None:
    allowed_third_party = {"grpc", "grpc_tools"}
    bad = []
    for path in source_files(ROOT, "proto"):
        for imp in imports_of(path, ROOT):
            if imp.top == "proto" or imp.top in allowed_third_party or imp.top in sys.stdlib_module_names:
                continue
            if imp.module == "google.protobuf" or imp.module.startswith("google.protobuf."):
                continue
            bad.append(imp.where(ROOT))
    assert not bad, "proto/ may import only google.protobuf, grpc and proto.*:\n" + "\n".join(bad)


def test_engine_does_not_import_ray_or_role_packages() -> None:
    bad = forbidden_imports("engine", {"ray", "prefill_worker", "decode_worker", "router", "cluster"})
    assert not bad, "engine/ is the shared core (DESIGN.md §2):\n" + "\n".join(bad)


@pytest.mark.parametrize(("package", "other"), [("prefill_worker", "decode_worker"),
                                                ("decode_worker", "prefill_worker")])
def test_roles_do_not_import_each_other(package: str, other: str) -> None:
    bad = forbidden_imports(package, {other})
    assert not bad, f"{package}/ must not import {other}/; move shared code to engine/:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "cluster"])
def test_only_cluster_imports_ray(package: str) -> None:
    bad = forbidden_imports(package, {"ray"})
    assert not bad, "only cluster/ may import ray:\n" + "\n".join(bad)


def test_router_never_reaches_torch_transformers_or_ray() -> None:
    bad = transitive_violations("router", {"torch", "transformers", "ray"})
    assert not bad, "router/ must stay torch-free, also through what it imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_source_files_stay_small(package: str) -> None:
    long = []
    for path in source_files(ROOT, package):
        if "_pb2" in path.name:
            continue  # generated
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines (DESIGN.md §9):\n" + "\n".join(long)


# -- the checker itself, on a throwaway tree ------------------------------------------------------

def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_closure_follows_function_level_relative_and_submodule_imports(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "router/__init__.py": "",
        "router/server.py": "import grpc\n\ndef serve():\n    from engine import helpers\n",
        "engine/__init__.py": "",
        "engine/helpers.py": "from . import deep\n",
        "engine/deep.py": "import os\nif os.name:\n    import torch.nn as nn\n",
        "engine/unrelated.py": "import transformers\n",
    })
    bad = transitive_violations("router", {"torch", "transformers"}, root=tmp_path)
    assert bad == ["engine/deep.py:3 imports torch.nn (reached via engine/deep.py <- engine/helpers.py "
                   "<- router/server.py)"]


def test_package_init_files_are_part_of_the_closure(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "router/__init__.py": "",
        "router/a.py": "import engine.clean\n",
        "engine/__init__.py": "from .clean import VALUE\nimport ray\n",
        "engine/clean.py": "VALUE = 1\n",
    })
    bad = transitive_violations("router", {"ray"}, root=tmp_path)
    assert bad == ["engine/__init__.py:2 imports ray (reached via engine/__init__.py <- router/a.py)"]
    assert forbidden_imports("engine", {"ray"}, root=tmp_path) == ["engine/__init__.py:2 imports ray"]
