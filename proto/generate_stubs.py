"""Regenerate the committed Python stubs from the .proto files.

From a checkout: ``python proto/generate_stubs.py``, or ``python -m pdserve.proto.generate_stubs``
with an editable install (either way it rewrites the stubs next to this file).
Needs ``grpcio-tools`` (test extra).
``tests/test_proto_stubs.py`` fails when the committed stubs differ from a fresh generation.

This folder is installed as the package ``pdserve.proto``, so protoc must see the sources as
``pdserve/proto/v1/*.proto``: the generated code then imports ``from pdserve.proto.v1 import ...``.
The protobuf package (the wire names) stays ``pdserve.v1``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "v1"
IMPORT_PREFIX = Path("pdserve", "proto", "v1")  # the sources' path as protoc sees it
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """The .proto sources, sorted."""
    return sorted(proto_dir.glob("*.proto"))


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto in ``proto_dir``.

    ``out_dir`` is a root: files land in ``out_dir/pdserve/proto/v1/``.
    Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="pdserve-protoc-") as tmp:
        include = Path(tmp)
        (include / IMPORT_PREFIX).mkdir(parents=True)
        for path in proto_files(proto_dir):
            shutil.copyfile(path, include / IMPORT_PREFIX / path.name)
        args = [
            "grpc_tools.protoc",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *[(IMPORT_PREFIX / p.name).as_posix() for p in proto_files(proto_dir)],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")


def regenerate(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Generate into a temp root, then copy the stubs next to the .proto files; returns them."""
    written = []
    with tempfile.TemporaryDirectory(prefix="pdserve-stubs-") as tmp:
        generate(Path(tmp), proto_dir)
        for stub in sorted((Path(tmp) / IMPORT_PREFIX).iterdir()):
            if stub.name.endswith(STUB_SUFFIXES):
                shutil.copyfile(stub, proto_dir / stub.name)
                written.append(proto_dir / stub.name)
    return written


if __name__ == "__main__":
    for path in regenerate():
        sys.stdout.write(f"wrote {path}\n")
