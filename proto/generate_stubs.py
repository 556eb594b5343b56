"""Regenerate the committed Python stubs from the .proto files.

Run from anywhere: ``python -m proto.generate_stubs``. Needs ``grpcio-tools`` (test extra).
``tests/test_proto_stubs.py`` fails when the committed stubs differ from a fresh generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path(__file__).resolve().parent / "pdserve" / "v1"


def proto_files() -> list[Path]:
    """The .proto sources, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto into ``out_dir``.

    ``out_dir`` is a root: files land in ``out_dir/proto/pdserve/v1/``.
    Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(ROOT)
    sys.stdout.write(f"generated stubs in {PROTO_DIR}\n")
