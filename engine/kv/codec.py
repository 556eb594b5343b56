"""Wire format for the KV cache a prefill worker hands to a decode worker.

A frame is::

    b"PDKV" | uint32 LE header length | msgpack header map | raw tensor bytes

The header is a msgpack map with the keys ``version, request_id, fingerprint, dtype, shape,
token_ids, first_token, first_token_unix_ns, sampling, nbytes, checksum``.  The tensor bytes are
the C-contiguous KV tensor reinterpreted as uint8 (so bfloat16 works without numpy support).  ``checksum`` is ``zlib.crc32`` of the tensor bytes: it
detects corruption in transit, it is not a security measure.  Nothing here uses
pickle; every size is checked against :class:`KvLimits` before any allocation.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Iterator

import msgpack
import torch

FORMAT_VERSION = 1
MAGIC = b"PDKV"
_PREFIX = struct.Struct("<4sI")
PREFIX_BYTES = _PREFIX.size  # 8
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HEADER_TYPES: dict[str, type] = {
    "request_id": str, "fingerprint": dict, "dtype": str, "shape": list, "token_ids": list,
    "first_token": int, "first_token_unix_ns": int, "sampling": dict, "nbytes": int, "checksum": int,
}


class KvCodecError(ValueError):
    """Raised for any KV payload that cannot be packed or accepted; the message says exactly what
    is wrong, e.g. ``"model fingerprint mismatch: num_layers 4 != 5"`` or ``"checksum mismatch"``."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of the model/KV layout; prefill and decode must agree exactly.

    ``dtype`` is the KV cache dtype name (``"float32"``, ``"float16"`` or
    ``"bfloat16"``); ``tokenizer_hash`` is the sha256 hex digest of tokenizer.json.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tokenizer_hash: str

    def to_dict(self) -> dict:
        """Plain dict of all fields, suitable for msgpack."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelFingerprint":
        """Build from a dict as produced by :meth:`to_dict`.

        Raises KvCodecError if ``d`` is not a dict, a key is missing or unknown,
        a value has the wrong type, or an integer field is not positive.
        """
        if not isinstance(d, dict):
            raise KvCodecError(f"fingerprint is not a map (got {type(d).__name__})")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                raise KvCodecError(f"fingerprint missing key {f.name!r}")
            v = d[f.name]
            if f.type == "int":
                if not _is_int(v) or v <= 0:
                    raise KvCodecError(f"fingerprint {f.name} must be a positive int, got {v!r}")
            elif not isinstance(v, str):
                raise KvCodecError(f"fingerprint {f.name} must be a str, got {type(v).__name__}")
            kwargs[f.name] = v
        if unknown := sorted(str(k) for k in d if k not in kwargs):
            raise KvCodecError(f"fingerprint has unknown keys: {', '.join(unknown)}")
        return cls(**kwargs)

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Differences as ``"<field> <self value> != <other value>"``; [] when equal."""
        pairs = [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)]
        return [f"{name} {a!r} != {b!r}" for name, a, b in pairs if a != b]


@dataclass(frozen=True)
class KvLimits:
    """Bounds a receiver enforces before allocating: sizes in bytes, token count of the KV tensor."""

    max_header_bytes: int = 1 << 20
    max_tensor_bytes: int = 4 << 30
    max_tokens: int = 1 << 20


@dataclass
class KvPayload:
    """KV cache of a prefilled prompt plus the state needed to continue decoding.

    ``kv`` has shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``
    (index 0 on dim 1 is K, 1 is V) and dtype ``fingerprint.dtype``;
    ``len(token_ids) == num_tokens``.  ``first_token`` is the token sampled by
    prefill; it is not in ``token_ids`` and its KV is not included.  ``sampling``
    holds only msgpack-able values (ints, floats, str, lists, dicts, None).
    """

    request_id: str
    fingerprint: ModelFingerprint
    token_ids: list[int]
    first_token: int
    sampling: dict
    kv: torch.Tensor
    first_token_unix_ns: int = 0  # wall clock when prefill sampled first_token (KV transfer timing)


def _check_shape(shape: list, fp: ModelFingerprint, num_tokens: int) -> None:
    if len(shape) != 5 or not all(_is_int(s) for s in shape):
        raise KvCodecError(f"shape must be 5 ints [layers, 2, tokens, kv_heads, head_dim], got {shape}")
    want = [fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim]
    if list(shape) != want:
        raise KvCodecError(f"shape {list(shape)} does not match fingerprint/token count {want}")
    if num_tokens < 1:
        raise KvCodecError("payload carries no tokens")


def pack_kv(payload: KvPayload) -> bytes:
    """Serialise ``payload`` into one frame (bytes).

    The tensor is made contiguous on CPU and copied once into the frame.
    Raises KvCodecError if the tensor dtype/shape disagrees with the fingerprint
    or token count, or if a header field cannot be encoded by msgpack.
    """
    fp = payload.fingerprint
    if payload.kv.dtype != _DTYPES.get(fp.dtype):
        raise KvCodecError(f"kv dtype {payload.kv.dtype} does not match fingerprint dtype {fp.dtype!r}")
    token_ids = [int(t) for t in payload.token_ids]
    _check_shape(list(payload.kv.shape), fp, len(token_ids))
    flat = payload.kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    data = memoryview(flat.numpy())
    header = {
        "version": FORMAT_VERSION, "request_id": payload.request_id, "fingerprint": fp.to_dict(),
        "dtype": fp.dtype, "shape": list(payload.kv.shape), "token_ids": token_ids,
        "first_token": int(payload.first_token), "first_token_unix_ns": int(payload.first_token_unix_ns),
        "sampling": payload.sampling,
        "nbytes": data.nbytes, "checksum": zlib.crc32(data),
    }
    try:
        hdr = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise KvCodecError(f"header not encodable: {e}") from e
    return b"".join((_PREFIX.pack(MAGIC, len(hdr)), hdr, data))


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def unpack_kv(
    data: bytes | bytearray | memoryview, expected: ModelFingerprint, limits: KvLimits = KvLimits()
) -> KvPayload:
    """Parse and fully validate a frame produced by :func:`pack_kv`.

    Returns a KvPayload whose ``kv`` ([num_layers, 2, num_tokens, num_kv_heads,
    head_dim]) owns its memory (one copy of the tensor bytes).  Raises
    KvCodecError, before allocating the tensor, for: bad magic; header length
    over ``limits.max_header_bytes`` or past the end of ``data``; undecodable or
    non-map header; unknown version; missing/wrong-typed keys; fingerprint
    differing from ``expected`` (all fields listed, "received != expected");
    dtype/shape disagreeing with fingerprint or token count; over
    ``limits.max_tokens`` tokens; nbytes inconsistent or over
    ``limits.max_tensor_bytes``; truncated or trailing data; crc32 mismatch.
    """
    mv = _as_bytes_view(data)
    if len(mv) < PREFIX_BYTES:
        raise KvCodecError(f"truncated frame: expected {PREFIX_BYTES} prefix bytes, got {len(mv)}")
    magic, hlen = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise KvCodecError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if hlen > limits.max_header_bytes:
        raise KvCodecError(f"header too large: {hlen} > limit {limits.max_header_bytes}")
    if PREFIX_BYTES + hlen > len(mv):
        raise KvCodecError(f"truncated frame: expected {hlen} header bytes, got {len(mv) - PREFIX_BYTES}")
    try:  # every msgpack element takes >= 1 byte (map entries >= 2): bound all lengths by hlen
        header = msgpack.unpackb(
            mv[PREFIX_BYTES : PREFIX_BYTES + hlen], raw=False, strict_map_key=True, max_str_len=hlen,
            max_bin_len=hlen, max_array_len=hlen, max_map_len=hlen // 2, max_ext_len=0,
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
    fp = ModelFingerprint.from_dict(header["fingerprint"])
    if diffs := fp.mismatches(expected):
        raise KvCodecError("model fingerprint mismatch: " + "; ".join(diffs))
    dtype_name = header["dtype"]
    if dtype_name not in _DTYPES:
        raise KvCodecError(f"unsupported dtype {dtype_name!r}")
    if dtype_name != fp.dtype:
        raise KvCodecError(f"dtype {dtype_name} does not match fingerprint dtype {fp.dtype}")
    dtype = _DTYPES[dtype_name]
    shape = header["shape"]
    _check_shape(shape, fp, len(token_ids))
    if shape[2] > limits.max_tokens:
        raise KvCodecError(f"too many tokens: {shape[2]} > limit {limits.max_tokens}")
    nbytes = header["nbytes"]
    want_nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != want_nbytes:
        raise KvCodecError(f"nbytes {nbytes} != {want_nbytes} implied by shape {shape} and dtype {dtype_name}")
    if nbytes > limits.max_tensor_bytes:
        raise KvCodecError(f"tensor too large: {nbytes} bytes > limit {limits.max_tensor_bytes}")
    body = mv[PREFIX_BYTES + hlen :]
    if len(body) < nbytes:
        raise KvCodecError(f"truncated frame: expected {nbytes} bytes of tensor data, got {len(body)}")
    if len(body) > nbytes:
        raise KvCodecError(f"trailing bytes: expected {nbytes} bytes of tensor data, got {len(body)}")
    if (crc := zlib.crc32(body)) != header["checksum"]:
        raise KvCodecError(f"checksum mismatch: header {header['checksum']:#010x}, data {crc:#010x}")

    kv = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(shape)
    return KvPayload(header["request_id"], fp, token_ids, header["first_token"], header["sampling"], kv,
                     header["first_token_unix_ns"])


def iter_chunks(frame: bytes | bytearray | memoryview, chunk_bytes: int = 1 << 20) -> Iterator[memoryview]:
    """Yield zero-copy memoryview slices of ``frame``, each at most ``chunk_bytes`` bytes.

    Raises ValueError if ``chunk_bytes <= 0``.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    mv = _as_bytes_view(frame)
    for start in range(0, len(mv), chunk_bytes):
        yield mv[start : start + chunk_bytes]


class FrameAssembler:
    """Reassembles a frame from chunks, refusing to grow past ``limits``.

    The cap is ``PREFIX_BYTES + max_header_bytes + max_tensor_bytes`` bytes.  As
    soon as the 8-byte prefix is complete, bad magic or a declared header length
    over ``max_header_bytes`` is refused too.  Checks run before a chunk is stored.
    """

    def __init__(self, limits: KvLimits = KvLimits()):
        self._limits = limits
        self._cap = PREFIX_BYTES + limits.max_header_bytes + limits.max_tensor_bytes
        self._chunks: list[bytes] = []
        self._size = 0
        self._head = b""

    def add(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append one chunk (copied unless it is already ``bytes``).

        Raises KvCodecError if the total would exceed the cap, or if the frame
        prefix has bad magic or declares a header over ``limits.max_header_bytes``.
        """
        mv = _as_bytes_view(chunk)
        if self._size + len(mv) > self._cap:
            raise KvCodecError(f"frame too large: {self._size + len(mv)} bytes > limit {self._cap}")
        if len(self._head) < PREFIX_BYTES:
            head = self._head + bytes(mv[: PREFIX_BYTES - len(self._head)])
            if len(head) == PREFIX_BYTES:
                magic, hlen = _PREFIX.unpack(head)
                if magic != MAGIC:
                    raise KvCodecError(f"bad magic {magic!r} (expected {MAGIC!r})")
                if hlen > self._limits.max_header_bytes:
                    raise KvCodecError(f"header too large: {hlen} > limit {self._limits.max_header_bytes}")
            self._head = head
        self._chunks.append(chunk if isinstance(chunk, bytes) else mv.tobytes())
        self._size += len(mv)

    def frame(self) -> bytes:
        """The bytes received so far, concatenated (validate with :func:`unpack_kv`)."""
        if len(self._chunks) > 1:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0] if self._chunks else b""
