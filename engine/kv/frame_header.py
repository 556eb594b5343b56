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
    "KvLimits",
    "check_kv_prefix",
    "check_shape",
    "parse_header",
]

FORMAT_VERSION = 2  # 2: the KV may start after a prefix the receiver holds (kv_start, prefix_hashes)
MAGIC = b"PDKV"
PREFIX_STRUCT = struct.Struct("<4sI")  # magic, header length (uint32 LE)
PREFIX_BYTES = PREFIX_STRUCT.size  # 8
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PREFIX_HASH_BYTES = 16  # engine/scheduling/prefix_hash.py
_HEADER_TYPES: dict[str, type] = {
    "request_id": str,
    "fingerprint": dict,
    "dtype": str,
    "shape": list,
    "token_ids": list,
    "first_token": int,
    "first_token_unix_ns": int,
    "sampling": dict,
    "nbytes": int,
    "checksum": int,
    "kv_start": int,
    "prefix_hashes": list,
}


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


def parse_header(raw: bytes | bytearray | memoryview, expected: ModelFingerprint, limits: KvLimits) -> dict:
    """Decode and check a header (see :func:`~pdserve.engine.kv.codec.unpack_kv`); adds the parsed
    ``fingerprint`` and ``torch_dtype``."""
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
        raise KvCodecError(f"unsupported format version {version!r} (expected {FORMAT_VERSION})")
    for key, typ in _HEADER_TYPES.items():
        if key not in header:
            raise KvCodecError(f"header missing key {key!r}")
        v = header[key]
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise KvCodecError(f"header key {key!r} must be {typ.__name__}, got {type(v).__name__}")
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
    nbytes = header["nbytes"]
    want_nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != want_nbytes:
        raise KvCodecError(f"nbytes {nbytes} != {want_nbytes} implied by shape {shape} and dtype {dtype_name}")
    if nbytes > limits.max_tensor_bytes:
        raise KvCodecError(f"tensor too large: {nbytes} bytes > limit {limits.max_tensor_bytes}")
    return header
