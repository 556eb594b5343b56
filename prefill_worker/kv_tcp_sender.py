"""KvSender over the KV data connection (``pdserve.engine.kv.tcp_wire``): frames go over a plain TCP
connection to the decode worker's KV port, which the worker's GetStats gives (``kv_tcp_port``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.kv import tcp_wire as wire
from pdserve.engine.kv.codec import Frame
from pdserve.engine.kv.framing import iter_chunks
from pdserve.engine.kv.transfer import KvTransferError
from pdserve.prefill_worker.kv_sender import GrpcKvSender
from pdserve.rpc.auth import cluster_secret, internal_channel
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.v1 import worker_pb2, worker_pb2_grpc

TCP_CHUNK_BYTES = 1 << 20  # bytes a DATA record carries at most: the receiver checks each while the next arrives
POOL_IDLE_S = 60.0  # an idle connection older than this is not reused (receivers close theirs after 300 s)
REPLY_GRACE_S = 1.0  # after a write fails, how long a refusal the receiver sent first may take to be read


class TcpKvSender:
    """Implements ``pdserve.engine.kv.transfer.KvSender``: pushes over TCP to a decode worker that
    offers a KV port, else through ``fallback`` (gRPC's PushKv; also its timeouts).

    A worker's port is asked once (GetStats) and asked again when a connection to it is refused (a
    restarted worker). Connections are kept per worker and reused after a push the receiver took;
    a push that failed or was cancelled closes its connection, which frees what the receiver had
    reserved for it. Errors are KvTransferError with a gRPC status code name, as ``GrpcKvSender``'s.
    """

    def __init__(self, fallback: GrpcKvSender | None = None, chunk_bytes: int = TCP_CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= wire.MAX_DATA_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{wire.MAX_DATA_BYTES}, got {chunk_bytes}")
        self.fallback = fallback or GrpcKvSender()
        self.chunk_bytes = chunk_bytes
        self._ports: dict[str, int | None] = {}
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}  # + since

    async def send_kv(self, target: str, request_id: str, frame: Frame) -> None:
        """Push ``frame`` to ``target`` ("host:port" of its gRPC server); errors as GrpcKvSender's."""
        if await self._port(target) is None:
            return await self.fallback.send_kv(target, request_id, frame)

        async def one():
            yield frame

        await self._push(target, request_id, one(), self.fallback.timeout_s)

    async def send_kv_stream(self, target: str, request_id: str, frames: AsyncIterator[Frame]) -> None:
        """Push a layer-wise stream's frames as ``frames`` yields them; its deadline is the fallback's
        ``stream_timeout_s``. A refusal from the receiver ends the push at once."""
        if await self._port(target) is None:
            return await self.fallback.send_kv_stream(target, request_id, frames)
        await self._push(target, request_id, frames, self.fallback.stream_timeout_s)

    async def _port(self, target: str) -> int | None:
        if target not in self._ports:
            try:
                async with internal_channel(target, GRPC_OPTIONS) as channel:
                    stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetStats(
                        worker_pb2.GetStatsRequest(), timeout=self.fallback.timeout_s
                    )
                self._ports[target] = stats.kv_tcp_port or None
            except grpc.aio.AioRpcError:  # unreachable now: gRPC's push says why; ask again next time
                return None
        return self._ports[target]

    async def _connect(self, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(target, [])
        while idle:
            reader, writer, since = idle.pop()
            if not reader.at_eof() and not writer.is_closing() and time.monotonic() - since < POOL_IDLE_S:
                return reader, writer
            writer.close()
        host = target.rsplit(":", 1)[0].strip("[]")
        try:
            reader, writer = await self._dial(host, self._ports[target])
        except ConnectionRefusedError:
            self._ports.pop(target, None)  # a restarted worker listens elsewhere
            if await self._port(target) is None:
                raise
            reader, writer = await self._dial(host, self._ports[target])
        writer.write(wire.PREFACE)
        return reader, writer

    async def _dial(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    async def _pieces(self, frames: AsyncIterator[Frame]):
        async for frame in frames:
            for piece in iter_chunks(frame, self.chunk_bytes):
                yield piece

    async def _push(self, target: str, request_id: str, frames: AsyncIterator[Frame], timeout_s: float) -> None:
        where = f"KV push of {request_id!r} to {target}"
        conn, reusable = None, False
        try:
            async with asyncio.timeout(timeout_s):
                conn = reader, writer = await self._connect(target)
                fields = {"request_id": request_id, "secret": cluster_secret(), "timeout_s": timeout_s}
                writer.write(wire.control(wire.OPEN, fields))
                sent_all, (kind, payload) = await _send_and_answer(writer, self._pieces(frames), reader)
                reusable = sent_all and kind == wire.OK
        except TimeoutError:
            reason = f"no answer within {timeout_s} s"
            raise KvTransferError(f"{where} failed: DEADLINE_EXCEEDED: {reason}", "DEADLINE_EXCEEDED", reason) from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            reason = f"the KV data connection failed: {exc!r}"
            raise KvTransferError(f"{where} failed: UNAVAILABLE: {reason}", "UNAVAILABLE", reason) from exc
        finally:
            if conn is not None and not reusable:
                conn[1].close()
        if reusable:
            self._idle.setdefault(target, []).append((*conn, time.monotonic()))
        if kind == wire.ERROR:
            error = wire.read_control(payload, {"code": str, "message": str})
            code, message = error["code"], error["message"]
            raise KvTransferError(f"{where} failed: {code}: {message}", code, message)
        if kind != wire.OK:
            raise KvTransferError(f"{where} failed: INTERNAL: reply {wire.KINDS[kind]}", "INTERNAL", "bad reply")

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer, _ in conns:
                writer.close()
        self._idle.clear()
        await self.fallback.close()


async def _send_and_answer(writer: asyncio.StreamWriter, pieces: AsyncIterator[memoryview], reader) -> tuple:
    """Write the push's DATA records and its CLOSE while listening for the receiver's answer, which
    may come first (a refusal, or an early OK when its Decode stream went away): then the sending
    stops at once, even while it waits for the prefill's next frame. Returns (whether the whole push
    went out, the answer record). Raises what the sending raised, unless an answer came in time."""
    send = asyncio.ensure_future(_send(writer, pieces))
    answer = asyncio.ensure_future(wire.read_record(reader))
    try:
        await asyncio.wait({send, answer}, return_when=asyncio.FIRST_COMPLETED)
        if send.done() and send.exception() is not None:
            if isinstance(send.exception(), OSError):  # the receiver may have said why it closed
                await asyncio.wait({answer}, timeout=REPLY_GRACE_S)
            if not answer.done() or answer.exception() is not None:
                raise send.exception()
        return send.done() and not send.exception(), await answer
    finally:
        send.cancel()
        answer.cancel()


async def _send(writer: asyncio.StreamWriter, pieces: AsyncIterator[memoryview]) -> None:
    async for piece in pieces:
        writer.write(wire.header(wire.DATA, len(piece)))
        writer.write(piece)
        await writer.drain()
    writer.write(wire.header(wire.CLOSE, 0))
    await writer.drain()
