"""Wire format for the KV cache a prefill worker hands to a decode worker.

A frame is::

    b"PDKV" | uint32 LE header length | msgpack header map | raw tensor bytes

The header is a msgpack map with the keys ``version`` (:data:`FORMAT_VERSION`, 3), ``kind``
("kv": a whole frame), ``request_id, fingerprint, dtype, shape, token_ids, first_token,
first_token_unix_ns, sampling, nbytes, checksum, kv_start, prefix_hashes``.  The tensor bytes are
the C-contiguous KV tensor reinterpreted as uint8 (so bfloat16 works without numpy support).
``checksum`` is the CRC-32 of the tensor bytes (``zlib.crc32``'s value, computed with ISA-L): it
detects corruption in transit, it is not a security measure.  Nothing here uses
pickle; every size is checked against :class:`KvLimits` before any allocation.

A frame may be held as one buffer or as a sequence of consecutive parts (:data:`Frame`):
:func:`encode_kv` returns the header and a view of the tensor's own memory without joining them, and
:class:`KvDecoder` (behind :func:`unpack_kv`) checks, checksums and copies the bytes piece by piece
as they arrive.  A hand-off so copies the tensor bytes only into the transport messages and into the
decoded tensor, and the receiver refuses a bad header before the tensor bytes travel.

The header's layout constants, :class:`KvLimits` and the header checks are in
:mod:`pdserve.engine.kv.frame_header`; this module encodes payloads and decodes whole frames. The
same framing carries a layer-wise stream (a "head" frame, one "layer" frame per layer and prefill
step, an "end" frame): :mod:`pdserve.engine.kv.layer_frames` describes and encodes it,
:mod:`pdserve.engine.kv.stream_decoder` reads either form from one ``PushKv`` call.  A receiver
refuses a frame of another format version with a KvCodecError that says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch
from isal.isal_zlib import crc32  # exactly zlib.crc32's values, ~6x faster here

from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint
from pdserve.engine.kv.frame_header import (
    DTYPES,
    FORMAT_VERSION,
    KIND_WHOLE,
    MAGIC,
    PREFIX_BYTES,
    PREFIX_STRUCT,
    KvLimits,
    check_kv_prefix,
    check_shape,
    parse_header,
    read_prefix,
)

__all__ = [
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

Buffer = bytes | bytearray | memoryview
Frame = Buffer | Sequence[Buffer]  # one buffer, or the frame's bytes as consecutive parts
_SLICE = 1 << 20  # tensor bytes are checksummed then copied in slices of this size, still in cache for the copy


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


def encode_kv(payload: KvPayload) -> tuple[bytes, memoryview]:
    """Serialise ``payload`` as two parts, ``(prefix + header, tensor bytes)``; the frame is their
    concatenation.

    The tensor bytes are a read-only view of the payload's tensor (made contiguous on CPU first, the
    only copy, and only when it is not already); the checksum is computed over that view.
    Raises KvCodecError if the tensor dtype/shape disagrees with the fingerprint or token count, or
    if a header field cannot be encoded by msgpack.
    """
    fp = payload.fingerprint
    if payload.kv.dtype != DTYPES.get(fp.dtype):
        raise KvCodecError(f"kv dtype {payload.kv.dtype} does not match fingerprint dtype {fp.dtype!r}")
    token_ids = [int(t) for t in payload.token_ids]
    check_kv_prefix(payload.kv_start, payload.prefix_hashes, fp, len(token_ids))
    check_shape(list(payload.kv.shape), fp, len(token_ids) - payload.kv_start)
    flat = payload.kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    data = memoryview(flat.numpy()).toreadonly()
    header = {
        "version": FORMAT_VERSION,
        "kind": KIND_WHOLE,
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
    return PREFIX_STRUCT.pack(MAGIC, len(hdr)) + hdr, data


def pack_kv(payload: KvPayload) -> bytes:
    """Serialise ``payload`` into one frame (bytes): :func:`encode_kv`'s parts joined (errors as there)."""
    return b"".join(encode_kv(payload))


def _as_bytes_view(data: Buffer) -> memoryview:
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def checksum_into(dst: memoryview, offset: int, src: memoryview, crc: int) -> int:
    """Copy ``src`` into ``dst[offset:]``, ``_SLICE`` bytes at a time, each slice checksummed just
    before its copy (while it is in cache); returns the CRC-32 carried on from ``crc``."""
    for i in range(0, len(src), _SLICE):
        piece = src[i : i + _SLICE]
        crc = crc32(piece, crc)
        dst[offset + i : offset + i + len(piece)] = piece
    return crc


def frame_parts(frame: Frame) -> list[memoryview]:
    """``frame`` as a list of flat byte views (one for a single buffer), empty parts dropped."""
    parts = [frame] if isinstance(frame, (bytes, bytearray, memoryview)) else frame
    return [mv for mv in map(_as_bytes_view, parts) if len(mv)]


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
                self._hlen = read_prefix(self._head, self._limits)
            if len(self._head) == PREFIX_BYTES + self._hlen:
                self._start_body()
        if not len(mv):
            return
        nbytes = self._header["nbytes"]
        if self._got + len(mv) > nbytes:
            raise KvCodecError(f"trailing bytes: expected {nbytes} bytes of tensor data, got {self._got + len(mv)}")
        self._crc = checksum_into(self._dst, self._got, mv, self._crc)
        self._got += len(mv)

    def _start_body(self) -> None:
        self._header = parse_header(memoryview(self._head)[PREFIX_BYTES:], self._expected, self._limits)
        self._head = bytearray()
        self._buf = self._alloc(self._header["nbytes"])  # size checked by parse_header
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
