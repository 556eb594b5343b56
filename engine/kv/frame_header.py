"""The header of a KV frame (format in :mod:`pdserve.engine.kv.codec`) and the checks it must pass.

This module holds the frame's layout constants (magic, the 8-byte prefix, format version, the KV
dtypes a frame may carry), :class:`KvLimits`, the bounds a receiver enforces before it allocates, and
the checks shared by both ends: :func:`check_shape` and :func:`check_kv_prefix` run on a payload
before it is encoded and on a received header, and :func:`parse_header` decodes and checks a received
header as a whole, before any tensor bytes are read.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import msgpack
import torch

from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint, _is_int

__all__ = [
    "DTYPES",
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_BYTES",
    "PREFIX_HASH_BYTES",
    "PREFIX_STRUCT",
    "KIND_END",
    "KIND_HEAD",
    "KIND_LAYER",
    "KIND_WHOLE",
    "KvLimits",
    "check_kv_prefix",
    "check_request_header",
    "check_shape",
    "check_types",
    "decode_header",
    "parse_header",
]

# 2: the KV may start after a prefix the receiver holds (kv_start, prefix_hashes); 3: every header
# names its ``kind``, a whole frame ("kv") or a frame of a layer-wise stream ("head", "layer", "end")
FORMAT_VERSION = 3
KIND_WHOLE, KIND_HEAD, KIND_LAYER, KIND_END = "kv", "head", "layer", "end"
MAGIC = b"PDKV"
PREFIX_STRUCT = struct.Struct("<4sI")  # magic, header length (uint32 LE)
PREFIX_BYTES = PREFIX_STRUCT.size  # 8
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREFIX_HASH_BYTES = 16  # engine/scheduling/prefix_hash.py
_HEAD_TYPES: dict[str, type] = {  # a layer-wise stream's head frame
    "request_id": str,
    "fingerprint": dict,
    "dtype": str,
    "shape": list,
    "token_ids": list,
    "sampling": dict,
    "nbytes": int,
    "checksum": int,
    "kv_start": int,
    "prefix_hashes": list,
}
_HEADER_TYPES: dict[str, type] = {**_HEAD_TYPES, "first_token": int, "first_token_unix_ns": int}  # a whole frame


@dataclass(frozen=True)
class KvLimits:
    """Bounds a receiver enforces before allocating: sizes in bytes, token count of the KV tensor."""

    max_header_bytes: int = 1 << 20
    max_tensor_bytes: int = 4 << 30
    max_tokens: int = 1 << 20


def check_shape(shape: list, fp: ModelFingerprint, num_tokens: int) -> None:
    """KvCodecError unless ``shape`` is ``[layers, 2, num_tokens, kv_heads, head_dim]`` of ``fp``."""
    if len(shape) != 5 or not all(_is_int(s) for s in shape):
        raise KvCodecError(f"shape must be 5 ints [layers, 2, tokens, kv_heads, head_dim], got {shape}")
    want = [fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim]
    if list(shape) != want:
        raise KvCodecError(f"shape {list(shape)} does not match fingerprint/token count {want}")
    if num_tokens < 1:
        raise KvCodecError("payload carries no tokens")


def check_kv_prefix(kv_start: int, hashes: list, fp: ModelFingerprint, num_tokens: int) -> None:
    """KvCodecError unless ``kv_start`` is a whole number of blocks, one per hash in ``hashes``."""
    if num_tokens and not 0 <= kv_start < num_tokens:  # (no tokens at all: check_shape says so)
        raise KvCodecError(f"kv_start {kv_start} outside [0, {num_tokens})")
    if kv_start != len(hashes) * fp.block_size:
        raise KvCodecError(f"kv_start {kv_start} is not {len(hashes)} prefix blocks of {fp.block_size} tokens")
    if not all(isinstance(h, bytes) and len(h) == PREFIX_HASH_BYTES for h in hashes):
        raise KvCodecError(f"prefix_hashes must be {PREFIX_HASH_BYTES}-byte strings")


def read_prefix(raw: bytes | bytearray, limits: KvLimits) -> int:
    """The header length a frame's first ``PREFIX_BYTES`` give; KvCodecError for a bad magic or a
    header over ``limits.max_header_bytes``."""
    magic, hlen = PREFIX_STRUCT.unpack(raw)
    if magic != MAGIC:
        raise KvCodecError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if hlen > limits.max_header_bytes:
        raise KvCodecError(f"header too large: {hlen} > limit {limits.max_header_bytes}")
    return hlen


def decode_header(raw: bytes | bytearray | memoryview) -> dict:
    """Decode a header into a map and check its ``version``: KvCodecError for bytes that are not a
    msgpack map, and for any version but :data:`FORMAT_VERSION` (a peer of another release)."""
    hlen = len(raw)
    try:  # every msgpack element takes >= 1 byte (map entries >= 2): bound all lengths by hlen
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=hlen,
            max_bin_len=hlen,
            max_array_len=hlen,
            max_map_len=hlen // 2,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise KvCodecError(f"malformed header: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise KvCodecError(f"header is not a map (got {type(header).__name__})")
    version = header.get("version")
    if version != FORMAT_VERSION or not _is_int(version):
        raise KvCodecError(
            f"unsupported format version {version!r} (expected {FORMAT_VERSION}): "
            "the prefill and decode workers run different pdserve releases"
        )
    return header


def check_types(header: dict, types: dict[str, type]) -> None:
    """KvCodecError unless ``header`` has every key of ``types`` with a value of that type."""
    for key, typ in types.items():
        if key not in header:
            raise KvCodecError(f"header missing key {key!r}")
        v = header[key]
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise KvCodecError(f"header key {key!r} must be {typ.__name__}, got {type(v).__name__}")


def parse_header(
    raw: bytes | bytearray | memoryview, expected: ModelFingerprint, limits: KvLimits, kind: str = KIND_WHOLE
) -> dict:
    """Decode and check a header (see :func:`~pdserve.engine.kv.codec.unpack_kv`) of a whole frame
    (``kind`` "kv") or of a layer-wise stream's head frame ("head": no first token yet, no tensor
    bytes, ``shape`` and the limits are those of the whole stream); adds the parsed ``fingerprint``
    and ``torch_dtype``."""
    return check_request_header(decode_header(raw), expected, limits, kind)


def check_request_header(header: dict, expected: ModelFingerprint, limits: KvLimits, kind: str = KIND_WHOLE) -> dict:
    """The checks of :func:`parse_header` on a decoded header."""
    if header.get("kind") != kind:
        raise KvCodecError(f"expected a frame of kind {kind!r}, got {header.get('kind')!r}")
    check_types(header, _HEADER_TYPES if kind == KIND_WHOLE else _HEAD_TYPES)
    token_ids = header["token_ids"]
    if not all(_is_int(t) for t in token_ids):
        raise KvCodecError("header token_ids must all be ints")
    fp = header["fingerprint"] = ModelFingerprint.from_dict(header["fingerprint"])
    if diffs := fp.mismatches(expected):
        raise KvCodecError("model fingerprint mismatch: " + "; ".join(diffs))
    dtype_name = header["dtype"]
    if dtype_name not in DTYPES:
        raise KvCodecError(f"unsupported dtype {dtype_name!r}")
    if dtype_name != fp.dtype:
        raise KvCodecError(f"dtype {dtype_name} does not match fingerprint dtype {fp.dtype}")
    dtype = header["torch_dtype"] = DTYPES[dtype_name]
    shape = header["shape"]
    check_kv_prefix(header["kv_start"], header["prefix_hashes"], fp, len(token_ids))
    check_shape(shape, fp, len(token_ids) - header["kv_start"])
    if shape[2] > limits.max_tokens:
        raise KvCodecError(f"too many tokens: {shape[2]} > limit {limits.max_tokens}")
    nbytes, want_nbytes = header["nbytes"], math.prod(shape) * dtype.itemsize
    if kind == KIND_HEAD:  # the head carries no tensor bytes; those of the whole stream must fit the limit
        if nbytes != 0 or header["checksum"] != 0:
            raise KvCodecError("a head frame carries no tensor bytes: its nbytes and checksum must be 0")
        nbytes = want_nbytes
    if nbytes != want_nbytes:
        raise KvCodecError(f"nbytes {nbytes} != {want_nbytes} implied by shape {shape} and dtype {dtype_name}")
    if nbytes > limits.max_tensor_bytes:
        raise KvCodecError(f"tensor too large: {nbytes} bytes > limit {limits.max_tensor_bytes}")
    return header
