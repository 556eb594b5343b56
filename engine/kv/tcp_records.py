"""Reading the records of a KV data connection (:mod:`pdserve.engine.kv.tcp_wire`) with as few copies
as a socket allows: a record's payload is received straight into a buffer of its own size
(``recv_into``), where asyncio's StreamReader would copy each byte twice more (into its buffer,
then out of it, moving the rest of the buffer down each time)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from pdserve.engine.kv.tcp_wire import RECORD, WireError, check_header

STAGING_BYTES = 256 << 10  # headers and records that arrive whole are read here first
MAX_BUFFERED_BYTES = 32 << 20  # received records not yet read; the socket is not read past this


class RecordReader(asyncio.BufferedProtocol):
    """A protocol that splits the bytes of one connection into records; :meth:`read` returns them.

    ``on_connect(reader)`` runs when the connection is made (a server starts its handler there).
    ``preface``: bytes the connection must start with. Bytes that are not records (another preface,
    an unknown kind, a record over its limit) close the connection and :meth:`read` raises WireError.
    Reading stops while ``max_buffered`` bytes of records wait.
    """

    def __init__(
        self,
        on_connect: Callable[[RecordReader], None] | None = None,
        preface: bytes = b"",
        max_buffered: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self.on_connect, self._preface = on_connect, preface
        self.max_buffered = max_buffered
        self.transport: asyncio.Transport | None = None
        self._staging, self._staged = bytearray(STAGING_BYTES), 0
        self._payload: bytearray | None = None  # the record being received into its own buffer
        self._kind, self._got = 0, 0
        self._records: collections.deque = collections.deque()
        self._buffered, self._paused = 0, False
        self._ended: BaseException | None = None  # why no more records will come
        self._waiter: asyncio.Future | None = None

    # asyncio's side
    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.on_connect is not None:
            self.on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._got :]
        return memoryview(self._staging)[self._staged :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._payload is not None:
            self._got += nbytes
            if self._got == len(self._payload):
                payload, self._payload = self._payload, None
                self._complete(self._kind, payload)
            return
        self._staged += nbytes
        try:
            self._parse()
        except WireError as exc:
            self._end(exc)
            self.transport.close()

    def eof_received(self) -> bool:
        self._end(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)

    # the reader's side
    async def read(self) -> tuple[int, bytes | bytearray]:
        """The next record's (kind, payload). Raises asyncio.IncompleteReadError when the connection
        ended (``partial`` empty when it ended between records), WireError for bytes that are not
        records, ConnectionError when it broke."""
        while not self._records:
            if self._ended is not None or self.transport is None or self.transport.is_closing():
                if isinstance(self._ended, (WireError, ConnectionError)):
                    raise self._ended
                partial = b"?" if self._staged or self._payload is not None else b""
                raise asyncio.IncompleteReadError(partial, None)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        kind, payload = self._records.popleft()
        self._buffered -= len(payload)
        if self._paused and self._buffered <= self.max_buffered // 2:
            self._paused = False
            self.transport.resume_reading()
        return kind, payload

    def _parse(self) -> None:
        staging, pos = memoryview(self._staging), 0
        if self._preface:
            if self._staged < len(self._preface):
                return
            if staging[: len(self._preface)] != self._preface:
                raise WireError("not a KV data connection (bad preface)")
            pos, self._preface = len(self._preface), b""
        while self._staged - pos >= RECORD.size:
            kind, nbytes = check_header(*RECORD.unpack_from(self._staging, pos))
            start, have = pos + RECORD.size, self._staged - pos - RECORD.size
            if have >= nbytes:
                self._complete(kind, bytes(staging[start : start + nbytes]))
                pos = start + nbytes
                continue
            self._payload = bytearray(nbytes)  # the rest is received into it
            self._payload[:have] = staging[start : self._staged]
            self._kind, self._got, pos = kind, have, self._staged
            break
        rest = self._staged - pos  # part of a header (< RECORD.size bytes), moved to the front
        if rest and pos:
            self._staging[:rest] = bytes(staging[pos : self._staged])
        self._staged = rest

    def _complete(self, kind: int, payload) -> None:
        self._records.append((kind, payload))
        self._buffered += len(payload)
        if not self._paused and self._buffered > self.max_buffered:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _end(self, exc: BaseException | None) -> None:
        if self._ended is None:
            self._ended = exc if exc is not None else EOFError()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
