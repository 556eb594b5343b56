"""Regenerate the committed Python stubs from the .proto files.

From a checkout: ``python proto/generate_stubs.py``, or ``python -m pdserve.proto.generate_stubs``
with an editable install (either way it rewrites the stubs next to the .proto files).
Needs ``grpcio-tools`` (test extra).
``tests/test_proto_stubs.py`` fails when the committed stubs differ from a fresh generation.

The sources live at ``proto/pdserve/v1/*.proto`` and import each other as ``pdserve/v1/...``, so
they compile from their own root (``protoc -I proto``) as other gRPC APIs do, inside this
repository or out of it. The stubs then import ``from pdserve.v1 import ...``, and the folder
installs as the package ``pdserve.v1``, whose name is also the protobuf package (the wire names).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root
PACKAGE = Path("pdserve", "v1")  # the sources' folder under the root, as protoc and imports see it
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """The .proto sources, sorted."""
    return sorted((root / PACKAGE).glob("*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto under ``root``.

    ``out_dir`` is a root: files land in ``out_dir/pdserve/v1/``.
    Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc

    (out_dir / PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[(PACKAGE / p.name).as_posix() for p in proto_files(root)],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def regenerate(root: Path = PROTO_ROOT) -> list[Path]:
    """Generate into a temp root, then copy the stubs next to the .proto files; returns them."""
    written = []
    with tempfile.TemporaryDirectory(prefix="pdserve-stubs-") as tmp:
        generate(Path(tmp), root)
        for stub in sorted((Path(tmp) / PACKAGE).iterdir()):
            if stub.name.endswith(STUB_SUFFIXES):
                shutil.copyfile(stub, root / PACKAGE / stub.name)
                written.append(root / PACKAGE / stub.name)
    return written


if __name__ == "__main__":
    for path in regenerate():
        sys.stdout.write(f"wrote {path}\n")
