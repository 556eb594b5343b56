"""RecordReader, the KV data connection's record parser, fed bytes cut at every place a socket may
cut them: the records come out whole and in order; a bad preface, an unknown kind or a record over
its limit ends the connection with WireError; the socket stops being read while records wait."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.kv import tcp_wire as wire
from pdserve.engine.kv.tcp_records import RecordReader


class Transport:
    def __init__(self) -> None:
        self.paused = self.closed = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def connect(**kw) -> tuple[RecordReader, Transport]:
    reader, transport = RecordReader(preface=wire.PREFACE, **kw), Transport()
    reader.connection_made(transport)
    return reader, transport


def feed(reader: RecordReader, data: bytes, cuts: list[int]) -> None:
    """Deliver ``data`` as a socket would, in pieces ending at ``cuts`` (each no larger than the
    buffer the reader offers)."""
    pos = 0
    for end in [*cuts, len(data)]:
        while pos < end:
            buf = reader.get_buffer(-1)
            n = min(len(buf), end - pos)
            buf[:n] = data[pos : pos + n]
            reader.buffer_updated(n)
            pos += n


STREAM = (
    wire.PREFACE
    + wire.control(wire.OPEN, {"request_id": "r", "timeout_s": 1.0})
    + wire.header(wire.DATA, 3)
    + b"abc"
    + wire.header(wire.DATA, 300_000)  # larger than the staging buffer
    + bytes(range(256)) * 1171
    + bytes(224)
    + wire.header(wire.CLOSE, 0)
)


async def read_all(reader: RecordReader) -> list[tuple[int, bytes]]:
    out = []
    while True:
        try:
            kind, payload = await reader.read()
        except asyncio.IncompleteReadError as exc:
            assert exc.partial == b""  # ended between records
            return out
        out.append((kind, bytes(payload)))


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 64, 4096, 299_999, len(STREAM)])
async def test_records_come_out_whole_wherever_the_bytes_are_cut(step):
    reader, _ = connect()
    feed(reader, STREAM, list(range(step, len(STREAM), step)))
    reader.eof_received()
    records = await read_all(reader)
    assert [k for k, _ in records] == [wire.OPEN, wire.DATA, wire.DATA, wire.CLOSE]
    assert wire.read_control(records[0][1], {"request_id": str})["request_id"] == "r"
    assert records[1][1] == b"abc"
    assert records[2][1] == bytes(range(256)) * 1171 + bytes(224)


async def test_a_connection_that_ends_inside_a_record_says_so():
    reader, _ = connect()
    feed(reader, STREAM[:-20], [])
    reader.eof_received()
    for _ in range(2):
        await reader.read()
    with pytest.raises(asyncio.IncompleteReadError) as info:
        await reader.read()
    assert info.value.partial  # not between records


@pytest.mark.parametrize(
    "data, words",
    [
        (b"GET / HTTP/1.1\r\n", "bad preface"),
        (wire.PREFACE + bytes([9, 0, 0, 0, 0]), "unknown KV record kind 9"),
        (wire.PREFACE + wire.header(wire.DATA, wire.MAX_DATA_BYTES + 1), "over its limit"),
        (wire.PREFACE + wire.header(wire.OPEN, wire.MAX_CONTROL_BYTES + 1), "over its limit"),
    ],
)
async def test_bytes_that_are_not_records_close_the_connection(data, words):
    reader, transport = connect()
    feed(reader, data, [])
    assert transport.closed
    with pytest.raises(wire.WireError, match=words):
        await reader.read()


async def test_the_socket_is_not_read_while_records_wait():
    reader, transport = connect(max_buffered=10_000)
    one = wire.header(wire.DATA, 4_000) + bytes(4_000)
    feed(reader, wire.PREFACE + one * 2, [])
    assert not transport.paused  # 8,000 bytes wait
    feed(reader, one, [])
    assert transport.paused  # 12,000
    await reader.read()
    assert transport.paused  # 8,000: above half the bound
    await reader.read()
    assert not transport.paused  # 4,000
