"""KvSender over gRPC: client-streams a KV frame to a decode worker's PushKv in chunks."""

from __future__ import annotations

import grpc

from pdserve.engine.kv.codec import iter_chunks
from pdserve.engine.kv.transfer import KvTransferError
from pdserve.engine.host.serving import GRPC_OPTIONS
from pdserve.proto.v1 import worker_pb2, worker_pb2_grpc


class GrpcKvSender:
    """Implements ``pdserve.engine.kv.transfer.KvSender``.

    Frames travel as ``KvChunk`` messages of at most ``chunk_bytes`` (default 1 MiB, below gRPC's
    4 MiB default message limit). One channel per decode worker is kept open.
    """

    def __init__(self, chunk_bytes: int = 1 << 20, timeout_s: float = 30.0) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._stubs: dict[str, worker_pb2_grpc.DecodeServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, target: str) -> worker_pb2_grpc.DecodeServiceStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = grpc.aio.insecure_channel(target, options=GRPC_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[target] = worker_pb2_grpc.DecodeServiceStub(channel)
        return stub

    async def send_kv(self, target: str, request_id: str, frame: bytes) -> None:
        """Stream ``frame`` to ``target``; KvTransferError with the gRPC status on failure."""

        def chunks():
            for i, piece in enumerate(iter_chunks(frame, self.chunk_bytes)):
                yield worker_pb2.KvChunk(request_id=request_id if i == 0 else "", data=bytes(piece))

        try:
            await self._stub(target).PushKv(chunks(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise KvTransferError(f"KV push of {request_id!r} to {target} failed: "
                                  f"{exc.code().name}: {exc.details()}") from exc

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
