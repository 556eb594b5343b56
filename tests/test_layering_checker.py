"""The checker of test_layering.py itself, on throwaway trees: what it follows, what it reports."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import (
    bare_imports,
    closure,
    forbidden_imports,
    imports_of,
    module_of,
    ours,
    transitive_violations,
)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_closure_follows_function_level_relative_and_submodule_imports(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "router/__init__.py": "",
            "router/grpc_api.py": "import grpc\n\ndef serve():\n    from pdserve.engine import helpers\n",
            "engine/__init__.py": "",
            "engine/helpers.py": "from . import deep\n",
            "engine/deep.py": "import os\nif os.name:\n    import torch.nn as nn\n",
            "engine/unrelated.py": "import transformers\n",
        },
    )
    bad = transitive_violations("router", {"torch", "transformers"}, root=tmp_path)
    assert bad == [
        "engine/deep.py:3 imports torch.nn (reached via engine/deep.py <- engine/helpers.py <- router/grpc_api.py)"
    ]


def test_package_init_files_are_part_of_the_closure(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "router/__init__.py": "",
            "router/a.py": "import pdserve.engine.clean\n",
            "engine/__init__.py": "from .clean import VALUE\nimport ray\n",
            "engine/clean.py": "VALUE = 1\n",
        },
    )
    bad = transitive_violations("router", {"ray"}, root=tmp_path)
    assert bad == ["engine/__init__.py:2 imports ray (reached via engine/__init__.py <- router/a.py)"]
    assert forbidden_imports("engine", {"ray"}, root=tmp_path) == ["engine/__init__.py:2 imports ray"]


def test_rules_match_namespaced_imports_and_flag_bare_ones(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/kv/__init__.py": "",
            "engine/kv/codec.py": "from ..config import X\nfrom pdserve.router import server\nimport engine.config\n",
            "engine/config.py": "X = 1\n",
            "router/__init__.py": "",
            "router/grpc_api.py": "import router\nimport pdserve.engine.kv.codec\n",
            "prefill_worker/__init__.py": "",
            "prefill_worker/w.py": "from pdserve import decode_worker\nimport decode_worker_helpers\n",
        },
    )
    codec = tmp_path / "engine" / "kv" / "codec.py"
    assert module_of(codec, tmp_path) == "pdserve.engine.kv.codec"
    assert [i.module for i in imports_of(codec, tmp_path)] == [
        "pdserve.engine.config",
        "pdserve.router",
        "engine.config",
    ]
    assert forbidden_imports("engine", {ours("router")}, root=tmp_path) == [
        "engine/kv/codec.py:2 imports pdserve.router"
    ]
    assert forbidden_imports("prefill_worker", {ours("decode_worker")}, root=tmp_path) == [
        "prefill_worker/w.py:1 imports pdserve.decode_worker"
    ]
    assert bare_imports(sorted(tmp_path.rglob("*.py")), tmp_path) == [
        "engine/kv/codec.py:3 imports engine.config",
        "router/grpc_api.py:1 imports router",
    ]
    parent = closure([tmp_path / "router" / "grpc_api.py"], tmp_path)
    assert codec in parent and tmp_path / "engine" / "config.py" in parent
