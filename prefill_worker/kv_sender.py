"""KvSender over gRPC: client-streams a KV frame, or a layer-wise stream of frames, to a decode
worker's PushKv in chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.kv.codec import Frame
from pdserve.engine.kv.framing import DEFAULT_CHUNK_BYTES, iter_chunks
from pdserve.engine.kv.transfer import KvTransferError
from pdserve.rpc.auth import internal_channel
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.v1 import worker_pb2

PUSH_KV_METHOD = "/pdserve.v1.DecodeService/PushKv"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_kv_chunk(chunk: tuple[str, memoryview]) -> bytes:
    """Wire bytes of ``KvChunk(request_id=chunk[0], data=chunk[1])``, identical to protobuf's
    ``SerializeToString``, built with one copy of the data (a message object would take three)."""
    request_id, data = chunk
    parts = []
    if request_id:
        rid = request_id.encode()
        parts += [b"\x0a", _varint(len(rid)), rid]  # field 1, length-delimited
    if len(data):
        parts += [b"\x12", _varint(len(data)), data]  # field 2, length-delimited
    return b"".join(parts)


class GrpcKvSender:
    """Implements ``pdserve.engine.kv.transfer.KvSender``.

    Frames travel as ``KvChunk`` messages of at most ``chunk_bytes`` bytes of frame data (default
    1 MiB, below gRPC's 4 MiB default message limit). One channel per decode worker is kept open.
    """

    def __init__(
        self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout_s: float = 30.0, stream_timeout_s: float = 300.0
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.stream_timeout_s = stream_timeout_s
        self._calls: dict[str, grpc.aio.StreamUnaryMultiCallable] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _push_kv(self, target: str) -> grpc.aio.StreamUnaryMultiCallable:
        call = self._calls.get(target)
        if call is None:
            channel = internal_channel(target, GRPC_OPTIONS)
            self._channels.append(channel)
            call = self._calls[target] = channel.stream_unary(
                PUSH_KV_METHOD,
                request_serializer=encode_kv_chunk,
                response_deserializer=worker_pb2.PushKvResponse.FromString,
            )
        return call

    async def send_kv(self, target: str, request_id: str, frame: Frame) -> None:
        """Stream ``frame`` to ``target``; on failure KvTransferError with the call's status code
        name as ``code`` and its details as ``reason`` (CANCELLED when gRPC ends the call with
        CancelledError, as it may when the deadline passes mid-write, unless this task itself is
        being cancelled)."""

        def chunks():
            for i, piece in enumerate(iter_chunks(frame, self.chunk_bytes)):
                yield (request_id if i == 0 else "", piece)

        await self._call(target, request_id, chunks(), self.timeout_s)

    async def send_kv_stream(self, target: str, request_id: str, frames: AsyncIterator[Frame]) -> None:
        """Stream the frames of a layer-wise stream (``pdserve.engine.kv.layer_frames``) to ``target``
        in one PushKv call, each frame's chunks as soon as ``frames`` yields it (a frame is never
        joined with the next). The call's deadline is ``stream_timeout_s`` (default 300 s, the
        router's wait for a KV on decode), as it lasts the prefill's forward. Errors as
        :meth:`send_kv`; cancelling this task cancels the call, and the decode worker frees what it
        reserved for the stream."""

        async def chunks():
            first = True
            async for frame in frames:
                for piece in iter_chunks(frame, self.chunk_bytes):
                    yield (request_id if first else "", piece)
                    first = False

        await self._call(target, request_id, chunks(), self.stream_timeout_s)

    async def _call(self, target: str, request_id: str, chunks, timeout_s: float) -> None:
        try:
            await self._push_kv(target)(chunks, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferError(
                f"KV push of {request_id!r} to {target} failed: {exc.code().name}: {exc.details()}",
                exc.code().name,
                exc.details() or "",
            ) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and getattr(task, "cancelling", lambda: 0)():  # this push itself was cancelled (3.11+)
                raise
            # grpc.aio ends a call whose deadline passes while it writes chunks with CancelledError
            raise KvTransferError(
                f"KV push of {request_id!r} to {target} cancelled by gRPC",
                "CANCELLED",
                "the push was cancelled (its deadline passed)",
            ) from None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
