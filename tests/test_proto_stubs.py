"""The committed gRPC stubs match the .proto files, and the .proto files follow their conventions
(docs/api.md, "Conventions of the .proto files")."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "pdserve" / "v1"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
STALE = "stubs are stale: run python proto/generate_stubs.py"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def stub_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(STUB_SUFFIXES)}


@pytest.fixture(scope="module")
def fresh_stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed", exc_type=ImportError)
    from pdserve.proto.generate_stubs import generate

    out = tmp_path_factory.mktemp("stubs")
    generate(out, PROTO_ROOT)  # the checkout's .proto files, not the installed copies
    return out / "pdserve" / "v1"


def test_every_proto_has_its_three_stubs(fresh_stubs: Path) -> None:
    expected = {p.stem + suffix for p in proto_files() for suffix in STUB_SUFFIXES}
    assert stub_names(fresh_stubs) == expected
    assert stub_names(PROTO_DIR) == expected, STALE


@pytest.mark.parametrize("name", sorted(p.stem + s for p in proto_files() for s in STUB_SUFFIXES))
def test_committed_stub_is_byte_identical_to_a_fresh_one(fresh_stubs: Path, name: str) -> None:
    committed = PROTO_DIR / name
    assert committed.is_file(), f"{name} is missing; {STALE}"
    assert committed.read_bytes() == (fresh_stubs / name).read_bytes(), f"{name}: {STALE}"


# -- docs/api.md, "Conventions of the .proto files": every field commented, enums start with *_UNSPECIFIED = 0

FIELD = re.compile(r"^(?:optional\s+|repeated\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*[;\[]")
ENUM_VALUE = re.compile(r"^(\w+)\s*=\s*(-?\d+)\s*[;\[]")
BLOCK = re.compile(r"^(message|enum|oneof|service)\s+(\w+)\s*\{")


@dataclass
class Member:
    """A message field or an enum value of a .proto file."""

    kind: str  # "field" or "enum value"
    owner: str  # enclosing message / enum name
    name: str
    number: int
    line: int  # 1-based
    commented: bool  # a // comment line sits directly above


def parse_members(text: str) -> list[Member]:
    """Fields and enum values with their enclosing block; nested blocks and one-line `{}` handled."""
    lines = text.splitlines()
    stack: list[tuple[str, str]] = []
    members = []
    for i, raw in enumerate(lines):
        line = raw.split("//", 1)[0].strip()
        block = BLOCK.match(line)
        opened = line.count("{")
        if block:
            kind, name = block.groups()
            # a oneof's fields belong to the enclosing message
            stack.append((kind, stack[-1][1] if kind == "oneof" and stack else name))
            opened -= 1
        elif stack and stack[-1][0] in ("message", "oneof", "enum"):
            kind, owner = stack[-1]
            match = (ENUM_VALUE if kind == "enum" else FIELD).match(line)
            if match and not line.startswith(("option ", "reserved ")):
                above = lines[i - 1].strip() if i else ""
                members.append(
                    Member(
                        "enum value" if kind == "enum" else "field",
                        owner,
                        match.group(1),
                        int(match.group(2)),
                        i + 1,
                        above.startswith("//"),
                    )
                )
        stack += [("other", "")] * opened  # e.g. an rpc's option block
        stack = stack[: max(0, len(stack) - line.count("}"))]
    return members


def proto_params():
    return [pytest.param(p, id=p.name) for p in proto_files()]


def test_there_are_proto_files() -> None:
    assert {p.name for p in proto_files()} >= {"generate.proto", "worker.proto"}


@pytest.mark.parametrize("path", proto_params())
def test_every_field_and_enum_value_has_a_comment_above(path: Path) -> None:
    members = parse_members(path.read_text(encoding="utf-8"))
    assert members, f"no fields parsed from {path.name}"
    bare = [f"{path.name}:{m.line}: {m.kind} {m.owner}.{m.name}" for m in members if not m.commented]
    assert not bare, "every field and enum value needs a // comment directly above it:\n" + "\n".join(bare)


@pytest.mark.parametrize("path", proto_files(), ids=lambda p: p.name)
def test_every_enum_starts_with_unspecified_zero(path: Path) -> None:
    values: dict[str, list[Member]] = {}
    for m in parse_members(path.read_text(encoding="utf-8")):
        if m.kind == "enum value":
            values.setdefault(m.owner, []).append(m)
    for enum, members in values.items():
        zero = [m.name for m in members if m.number == 0]
        assert len(zero) == 1, f"{path.name}: enum {enum} needs exactly one zero value, has {zero}"
        assert zero[0].endswith("_UNSPECIFIED"), (
            f"{path.name}: {enum}'s zero value {zero[0]} must end with _UNSPECIFIED"
        )
        assert members[0].number == 0, f"{path.name}: {enum} must start with its zero value"


def test_parser_sees_fields_oneofs_nested_blocks_and_comments() -> None:
    text = """
// A thing.
message Outer {
  // the id
  string id = 1;
  repeated uint32 ids = 2;  // trailing comments do not count
  message Inner {}
  oneof kind {
    // a
    Inner a = 3;
    map<string, int32> b = 4;
  }
  // after the nested blocks
  optional float t = 5 [deprecated = true];
}
service S {
  rpc Get(Outer) returns (Outer) { option deprecated = true; }
  // not a field
}
enum Color {
  option allow_alias = true;
  COLOR_RED = 0;
  // blue
  COLOR_BLUE = 1;
}
"""
    got = [(m.kind, m.owner, m.name, m.number, m.commented) for m in parse_members(text)]
    assert got == [
        ("field", "Outer", "id", 1, True),
        ("field", "Outer", "ids", 2, False),
        ("field", "Outer", "a", 3, True),
        ("field", "Outer", "b", 4, False),
        ("field", "Outer", "t", 5, True),
        ("enum value", "Color", "COLOR_RED", 0, False),
        ("enum value", "Color", "COLOR_BLUE", 1, True),
    ]


@pytest.mark.parametrize("path", proto_files(), ids=lambda p: p.name)
def test_parser_finds_every_field_the_compiler_knows(path: Path) -> None:
    import importlib

    module = importlib.import_module(f"pdserve.v1.{path.stem}_pb2")
    desc = module.DESCRIPTOR
    known = {("field", m.name, f.name, f.number) for m in desc.message_types_by_name.values() for f in m.fields}
    known |= {("enum value", e.name, v.name, v.number) for e in desc.enum_types_by_name.values() for v in e.values}
    parsed = {(m.kind, m.owner, m.name, m.number) for m in parse_members(path.read_text(encoding="utf-8"))}
    assert parsed == known
