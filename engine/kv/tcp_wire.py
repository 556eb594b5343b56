"""The KV data connection: how a prefill worker pushes KV frames to a decode worker over a plain
TCP connection, beside gRPC (``--kv-transport tcp``).

gRPC copies each message through HTTP/2 framing in Python and C-core, which caps a push near
0.6 GB/s on loopback; a socket moves the same bytes at several GB/s (docs/measurements.md). The
connection carries only the frames of :mod:`pdserve.engine.kv.codec`, which check themselves
(version, fingerprint, checksums); requests, tokens and errors stay on gRPC.

A connection opens with :data:`PREFACE`, then carries pushes one after another. Each message is a
*record*: 1 byte kind, 4 bytes little-endian payload length, the payload.

- sender: ``OPEN`` (msgpack map: ``request_id`` str, ``secret`` str or nil, ``timeout_s`` float),
  ``DATA`` records (the frames' bytes, in order, any cut), then an empty ``CLOSE``;
- receiver: ``OK`` (msgpack map: ``received_bytes``) once the push is taken, or ``ERROR`` (msgpack
  map: ``code``, a gRPC status code name, and ``message``) at any point, after which it closes the
  connection. A connection that ends inside a push is a push cut short: the receiver frees what it
  had reserved for it.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack

PREFACE = b"PDKV\x01"  # magic and wire version
RECORD = struct.Struct("<BI")
OPEN, DATA, CLOSE, OK, ERROR = 1, 2, 3, 4, 5
MAX_CONTROL_BYTES = 64 << 10  # an OPEN, OK or ERROR payload
MAX_DATA_BYTES = 64 << 20  # one DATA record; the frame's own limits (KvLimits) bound the whole push
KINDS = {OPEN: "OPEN", DATA: "DATA", CLOSE: "CLOSE", OK: "OK", ERROR: "ERROR"}


class WireError(ConnectionError):
    """The peer broke the record format (unknown kind, a record over its size limit, a bad preface)."""


def header(kind: int, nbytes: int) -> bytes:
    """The 5 bytes before a record's payload of ``nbytes`` bytes."""
    return RECORD.pack(kind, nbytes)


def control(kind: int, fields: dict) -> bytes:
    """A whole OPEN, OK or ERROR record with ``fields`` as its msgpack payload."""
    payload = msgpack.packb(fields)
    return header(kind, len(payload)) + payload


async def read_record(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The next record's (kind, payload). Raises asyncio.IncompleteReadError when the connection
    ends (``partial`` empty: between records), WireError for an unknown kind or an oversized record."""
    kind, nbytes = check_header(*RECORD.unpack(await reader.readexactly(RECORD.size)))
    return kind, await reader.readexactly(nbytes) if nbytes else b""


def check_header(kind: int, nbytes: int) -> tuple[int, int]:
    """``(kind, nbytes)`` of a record header; WireError for an unknown kind or a record over its limit."""
    if kind not in KINDS:
        raise WireError(f"unknown KV record kind {kind}")
    limit = MAX_DATA_BYTES if kind == DATA else MAX_CONTROL_BYTES
    if nbytes > limit:
        raise WireError(f"KV {KINDS[kind]} record of {nbytes} bytes is over its limit of {limit}")
    return kind, nbytes


def read_control(payload: bytes, fields: dict[str, type]) -> dict:
    """``payload``'s msgpack map, checked to hold ``fields`` (name -> type); WireError otherwise."""
    try:
        value = msgpack.unpackb(payload)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError(f"unreadable KV control record: {exc}") from None
    if not isinstance(value, dict):
        raise WireError("a KV control record must be a map")
    for name, kind in fields.items():
        if not isinstance(value.get(name), kind):
            raise WireError(f"KV control record field {name!r} missing or not {getattr(kind, '__name__', kind)}")
    return value
