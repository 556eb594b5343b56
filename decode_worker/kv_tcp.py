"""The decode side of the KV data connection (``pdserve.engine.kv.tcp_wire``): a TCP listener beside
the worker's gRPC server whose pushes go to the same ``DecodeWorker.take_push`` as PushKv's."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from pdserve.engine.kv import tcp_wire as wire
from pdserve.engine.kv.tcp_records import RecordReader
from pdserve.rpc.auth import cluster_secret

log = logging.getLogger(__name__)
OPEN_FIELDS = {"request_id": str, "timeout_s": (int, float)}
REFUSAL_LINGER_S = 2.0  # how long a refused push's remaining bytes are read before the connection closes
IDLE_CLOSE_S = 300.0  # a connection that starts no push for this long is closed (senders keep theirs 60 s)
MAX_PUSH_S = 3600.0  # the longest deadline a sender may ask for


class KvTcpServer:
    """Serves pushes for ``receiver`` (a ``DecodeWorker``) on ``host``; :meth:`start` returns the port.

    With a cluster secret in the environment, an OPEN without it is refused (UNAUTHENTICATED) and
    the connection closed. A push past the sender's ``timeout_s`` is refused (DEADLINE_EXCEEDED). A
    connection that breaks the record format, or starts no push for ``IDLE_CLOSE_S``, is closed;
    other connections keep going.
    """

    def __init__(self, receiver) -> None:
        self.receiver = receiver
        self._secret = cluster_secret()
        self._server: asyncio.Server | None = None
        self.port = 0  # while listening, the port; GetStats names it
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: RecordReader(self._spawn, wire.PREFACE), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self.port = 0
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    def _spawn(self, conn: RecordReader) -> None:
        task = asyncio.ensure_future(self._connection(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _connection(self, conn: RecordReader) -> None:
        try:
            while await self._push(conn):
                pass
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, wire.WireError):
                log.warning("KV data connection from %s closed: %s", conn.transport.get_extra_info("peername"), exc)
        except asyncio.CancelledError:  # stop(): this task is the server's own, nobody awaits its outcome
            pass
        finally:
            conn.transport.close()

    async def _push(self, conn: RecordReader) -> bool:
        """Serve one push; False when the connection is to close (after a refusal, or idle)."""
        try:
            async with asyncio.timeout(IDLE_CLOSE_S):
                kind, payload = await conn.read()
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return False  # the sender closed between pushes
        except TimeoutError:
            return False
        if kind != wire.OPEN:
            raise wire.WireError(f"expected OPEN, got {wire.KINDS[kind]}")
        fields = wire.read_control(payload, OPEN_FIELDS)
        presented = fields.get("secret")
        if self._secret and not (
            isinstance(presented, str) and hmac.compare_digest(self._secret.encode(), presented.encode())
        ):
            return await _refuse(conn, "UNAUTHENTICATED", "the KV push lacks the cluster secret")
        from pdserve.decode_worker.worker import KvPushRefused

        try:
            async with asyncio.timeout(min(max(float(fields["timeout_s"]), 0.0), MAX_PUSH_S)):
                data = _Data(conn)
                received = await self.receiver.take_push(fields["request_id"], aiter(data))
        except KvPushRefused as exc:
            return await _refuse(conn, exc.code.name, exc.message)
        except TimeoutError:
            return await _refuse(conn, "DEADLINE_EXCEEDED", "the KV push did not end within its deadline")
        conn.transport.write(wire.control(wire.OK, {"received_bytes": received}))
        return data.closed  # taken before its CLOSE (its Decode stream went away): the rest is not read


class _Data:
    """The DATA payloads of one push, iterated up to its CLOSE (then ``closed``). A connection that
    ends first ends the data there, so the push is judged on what it received (a cut stream is
    refused as truncated)."""

    def __init__(self, conn: RecordReader) -> None:
        self.conn, self.closed = conn, False

    async def __aiter__(self):
        while True:
            try:
                kind, payload = await self.conn.read()
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if kind == wire.CLOSE:
                self.closed = True
                return
            if kind != wire.DATA:
                raise wire.WireError(f"expected DATA or CLOSE, got {wire.KINDS[kind]}")
            yield payload


async def _refuse(conn: RecordReader, code: str, message: str) -> bool:
    """Answer ERROR; the connection then closes. What the sender still sends is read and dropped
    until it closes (it stops at the answer): a socket closed on unread bytes would reset the
    connection, and the answer could be lost with it."""
    conn.transport.write(wire.control(wire.ERROR, {"code": code, "message": message}))
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        async with asyncio.timeout(REFUSAL_LINGER_S):
            while True:
                await conn.read()
    return False
