"""Wire format for the KV cache a prefill worker hands to a decode worker.

A frame is::

    b"PDKV" | uint32 LE header length | msgpack header map | raw tensor bytes

The header is a msgpack map with the keys ``version, request_id, fingerprint, dtype, shape,
token_ids, first_token, first_token_unix_ns, sampling, nbytes, checksum``.  The tensor bytes are
the C-contiguous KV tensor reinterpreted as uint8 (so bfloat16 works without numpy support).
``checksum`` is the CRC-32 of the tensor bytes (``zlib.crc32``'s value, computed with ISA-L): it
detects corruption in transit, it is not a security measure.  Nothing here uses
pickle; every size is checked against :class:`KvLimits` before any allocation.

A frame may be held as one buffer or as a sequence of consecutive parts (:data:`Frame`):
:func:`encode_kv` returns the header and a view of the tensor's own memory without joining them, and
:class:`KvDecoder` (behind :func:`unpack_kv`) checks, checksums and copies the bytes piece by piece
as they arrive.  A hand-off so copies the tensor bytes only into the transport messages and into the
decoded tensor, and the receiver refuses a bad header before the tensor bytes travel.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

import msgpack
import torch
from isal.isal_zlib import crc32  # exactly zlib.crc32's values, ~6x faster here

from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint, _is_int

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PREFIX_BYTES",
    "Buffer",
    "Frame",
    "KvCodecError",
    "KvDecoder",
    "KvLimits",
    "KvPayload",
    "ModelFingerprint",
    "crc32",
    "encode_kv",
    "frame_parts",
    "pack_kv",
    "unpack_kv",
]

FORMAT_VERSION = 2  # 2: the KV may start after a prefix the receiver holds (kv_start, prefix_hashes)
MAGIC = b"PDKV"
_PREFIX = struct.Struct("<4sI")
PREFIX_BYTES = _PREFIX.size  # 8
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
Buffer = Union[bytes, bytearray, memoryview]
Frame = Union[Buffer, Sequence[Buffer]]  # one buffer, or the frame's bytes as consecutive parts
_SLICE = 1 << 20  # tensor bytes are checksummed then copied in slices of this size, still in cache for the copy
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
PREFIX_HASH_BYTES = 16  # engine/scheduling/prefix_hash.py


@dataclass(frozen=True)
class KvLimits:
    """Bounds a receiver enforces before allocating: sizes in bytes, token count of the KV tensor."""

    max_header_bytes: int = 1 << 20
    max_tensor_bytes: int = 4 << 30
    max_tokens: int = 1 << 20


@dataclass
class KvPayload:
    """KV cache of a prefilled prompt plus the state needed to continue decoding.

    ``kv`` has shape ``[num_layers, 2, num_tokens - kv_start, num_kv_heads, head_dim]``
    (index 0 on dim 1 is K, 1 is V) and dtype ``fingerprint.dtype``, where
    ``num_tokens = len(token_ids)``: the KV of positions ``kv_start ..``. The positions before
    ``kv_start`` (whole blocks) are a prefix the receiver said it holds; ``prefix_hashes`` names
    those blocks (``engine.scheduling.prefix_hash``), so the receiver checks it holds exactly them.
    ``first_token`` is the token sampled by prefill; it is not in ``token_ids`` and its KV is not
    included.  ``sampling`` holds only msgpack-able values (ints, floats, str, lists, dicts, None).
    """

    request_id: str
    fingerprint: ModelFingerprint
    token_ids: list[int]
    first_token: int
    sampling: dict
    kv: torch.Tensor
    first_token_unix_ns: int = 0  # wall clock when prefill sampled first_token (KV transfer timing)
    kv_start: int = 0
    prefix_hashes: list[bytes] = field(default_factory=list)


def _check_shape(shape: list, fp: ModelFingerprint, num_tokens: int) -> None:
    if len(shape) != 5 or not all(_is_int(s) for s in shape):
        raise KvCodecError(f"shape must be 5 ints [layers, 2, tokens, kv_heads, head_dim], got {shape}")
    want = [fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim]
    if list(shape) != want:
        raise KvCodecError(f"shape {list(shape)} does not match fingerprint/token count {want}")
    if num_tokens < 1:
        raise KvCodecError("payload carries no tokens")


def _check_prefix(kv_start: int, hashes: list, fp: ModelFingerprint, num_tokens: int) -> None:
    if num_tokens and not 0 <= kv_start < num_tokens:  # (no tokens at all: _check_shape says so)
        raise KvCodecError(f"kv_start {kv_start} outside [0, {num_tokens})")
    if kv_start != len(hashes) * fp.block_size:
        raise KvCodecError(f"kv_start {kv_start} is not {len(hashes)} prefix blocks of {fp.block_size} tokens")
    if not all(isinstance(h, bytes) and len(h) == PREFIX_HASH_BYTES for h in hashes):
        raise KvCodecError(f"prefix_hashes must be {PREFIX_HASH_BYTES}-byte strings")


def encode_kv(payload: KvPayload) -> tuple[bytes, memoryview]:
    """Serialise ``payload`` as two parts, ``(prefix + header, tensor bytes)``; the frame is their
    concatenation.

    The tensor bytes are a read-only view of the payload's tensor (made contiguous on CPU first, the
    only copy, and only when it is not already); the checksum is computed over that view.
    Raises KvCodecError if the tensor dtype/shape disagrees with the fingerprint or token count, or
    if a header field cannot be encoded by msgpack.
    """
    fp = payload.fingerprint
    if payload.kv.dtype != _DTYPES.get(fp.dtype):
        raise KvCodecError(f"kv dtype {payload.kv.dtype} does not match fingerprint dtype {fp.dtype!r}")
    token_ids = [int(t) for t in payload.token_ids]
    _check_prefix(payload.kv_start, payload.prefix_hashes, fp, len(token_ids))
    _check_shape(list(payload.kv.shape), fp, len(token_ids) - payload.kv_start)
    flat = payload.kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    data = memoryview(flat.numpy()).toreadonly()
    header = {
        "version": FORMAT_VERSION,
        "request_id": payload.request_id,
        "fingerprint": fp.to_dict(),
        "dtype": fp.dtype,
        "shape": list(payload.kv.shape),
        "token_ids": token_ids,
        "first_token": int(payload.first_token),
        "first_token_unix_ns": int(payload.first_token_unix_ns),
        "sampling": payload.sampling,
        "nbytes": data.nbytes,
        "checksum": crc32(data),
        "kv_start": int(payload.kv_start),
        "prefix_hashes": [bytes(h) for h in payload.prefix_hashes],
    }
    try:
        hdr = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise KvCodecError(f"header not encodable: {e}") from e
    return _PREFIX.pack(MAGIC, len(hdr)) + hdr, data


def pack_kv(payload: KvPayload) -> bytes:
    """Serialise ``payload`` into one frame (bytes): :func:`encode_kv`'s parts joined (errors as there)."""
    return b"".join(encode_kv(payload))


def _as_bytes_view(data: Buffer) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def frame_parts(frame: Frame) -> list[memoryview]:
    """``frame`` as a list of flat byte views (one for a single buffer), empty parts dropped."""
    parts = [frame] if isinstance(frame, (bytes, bytearray, memoryview)) else frame
    return [mv for mv in map(_as_bytes_view, parts) if len(mv)]


def _parse_header(raw: Buffer, expected: ModelFingerprint, limits: KvLimits) -> dict:
    """Decode and check a header (see :func:`unpack_kv`); adds the parsed ``fingerprint`` and ``torch_dtype``."""
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
    if dtype_name not in _DTYPES:
        raise KvCodecError(f"unsupported dtype {dtype_name!r}")
    if dtype_name != fp.dtype:
        raise KvCodecError(f"dtype {dtype_name} does not match fingerprint dtype {fp.dtype}")
    dtype = header["torch_dtype"] = _DTYPES[dtype_name]
    shape = header["shape"]
    _check_prefix(header["kv_start"], header["prefix_hashes"], fp, len(token_ids))
    _check_shape(shape, fp, len(token_ids) - header["kv_start"])
    if shape[2] > limits.max_tokens:
        raise KvCodecError(f"too many tokens: {shape[2]} > limit {limits.max_tokens}")
    nbytes = header["nbytes"]
    want_nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != want_nbytes:
        raise KvCodecError(f"nbytes {nbytes} != {want_nbytes} implied by shape {shape} and dtype {dtype_name}")
    if nbytes > limits.max_tensor_bytes:
        raise KvCodecError(f"tensor too large: {nbytes} bytes > limit {limits.max_tensor_bytes}")
    return header


class KvDecoder:
    """Incremental :func:`unpack_kv`: :meth:`add` a frame's bytes in pieces of any size, then :meth:`finish`.

    Each check runs as soon as its bytes are in: the prefix (magic, header length) on its 8th byte,
    the whole header (fingerprint, shape, limits) on its last, so a bad frame is refused before its
    tensor bytes travel and nothing is allocated before the header passed.  Tensor bytes are then
    checksummed and copied once, into the tensor's own buffer, as they arrive.  Every error is a
    KvCodecError with :func:`unpack_kv`'s messages; a decoder that raised must be dropped.
    ``alloc(nbytes)`` returns that buffer (a uint8 CPU tensor of ``nbytes``; default ``torch.empty``).
    """

    def __init__(
        self,
        expected: ModelFingerprint,
        limits: KvLimits = KvLimits(),
        alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self._expected, self._limits = expected, limits
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        self._head = bytearray()  # prefix, then prefix + header, until the header is parsed
        self._hlen: int | None = None
        self._header: dict | None = None
        self._buf: torch.Tensor | None = None
        self._dst = memoryview(b"")
        self._got = self._crc = 0
        self.received = 0  # bytes passed to add() so far

    def add(self, chunk: Buffer) -> None:
        """Consume the next bytes of the frame (KvCodecError as soon as they show it is bad)."""
        mv = _as_bytes_view(chunk)
        self.received += len(mv)
        while self._header is None and len(mv):
            need = PREFIX_BYTES + (self._hlen or 0)
            take = need - len(self._head)
            self._head += mv[:take]
            mv = mv[take:]
            if len(self._head) < need:
                return
            if self._hlen is None:
                self._hlen = self._check_prefix()
            if len(self._head) == PREFIX_BYTES + self._hlen:
                self._start_body()
        if not len(mv):
            return
        nbytes = self._header["nbytes"]
        if self._got + len(mv) > nbytes:
            raise KvCodecError(f"trailing bytes: expected {nbytes} bytes of tensor data, got {self._got + len(mv)}")
        for i in range(0, len(mv), _SLICE):
            piece = mv[i : i + _SLICE]
            self._crc = crc32(piece, self._crc)
            self._dst[self._got : self._got + len(piece)] = piece
            self._got += len(piece)

    def _check_prefix(self) -> int:
        magic, hlen = _PREFIX.unpack(self._head)
        if magic != MAGIC:
            raise KvCodecError(f"bad magic {magic!r} (expected {MAGIC!r})")
        if hlen > self._limits.max_header_bytes:
            raise KvCodecError(f"header too large: {hlen} > limit {self._limits.max_header_bytes}")
        return hlen

    def _start_body(self) -> None:
        self._header = _parse_header(memoryview(self._head)[PREFIX_BYTES:], self._expected, self._limits)
        self._head = bytearray()
        self._buf = self._alloc(self._header["nbytes"])  # size checked by _parse_header
        self._dst = memoryview(self._buf.numpy())

    def finish(self) -> KvPayload:
        """The payload, once the whole frame was added; KvCodecError for a truncated frame or bad checksum."""
        h = self._header
        if self._hlen is None:
            raise KvCodecError(f"truncated frame: expected {PREFIX_BYTES} prefix bytes, got {len(self._head)}")
        if h is None:
            raise KvCodecError(
                f"truncated frame: expected {self._hlen} header bytes, got {len(self._head) - PREFIX_BYTES}"
            )
        if self._got < h["nbytes"]:
            raise KvCodecError(f"truncated frame: expected {h['nbytes']} bytes of tensor data, got {self._got}")
        if self._crc != h["checksum"]:
            raise KvCodecError(f"checksum mismatch: header {h['checksum']:#010x}, data {self._crc:#010x}")
        kv = self._buf.view(h["torch_dtype"]).reshape(h["shape"])
        return KvPayload(
            h["request_id"],
            h["fingerprint"],
            h["token_ids"],
            h["first_token"],
            h["sampling"],
            kv,
            h["first_token_unix_ns"],
            h["kv_start"],
            h["prefix_hashes"],
        )


def unpack_kv(data: Frame, expected: ModelFingerprint, limits: KvLimits = KvLimits()) -> KvPayload:
    """Parse and fully validate a frame produced by :func:`pack_kv` / :func:`encode_kv`.

    ``data`` is the frame as one buffer or as its consecutive parts (read in place, see
    :class:`KvDecoder`).  Returns a KvPayload whose ``kv`` ([num_layers, 2, num_tokens, num_kv_heads,
    head_dim]) owns its memory (one copy of the tensor bytes).  Raises
    KvCodecError, before allocating the tensor, for: bad magic; header length
    over ``limits.max_header_bytes`` or past the end of ``data``; undecodable or
    non-map header; unknown version; missing/wrong-typed keys; fingerprint
    differing from ``expected`` (all fields listed, "received != expected");
    dtype/shape disagreeing with fingerprint or token count; over
    ``limits.max_tokens`` tokens; nbytes inconsistent or over
    ``limits.max_tensor_bytes``; and after it for trailing or truncated data or a crc32 mismatch.
    """
    decoder = KvDecoder(expected, limits)
    for part in frame_parts(data):
        decoder.add(part)
    return decoder.finish()
