"""The seam between prefill and decode: how a packed KV frame reaches a decode worker.

A prefill worker holds a :class:`KvSender`; a decode worker implements
:class:`KvReceiver`.  Frames are produced by :func:`pdserve.engine.kv.codec.encode_kv` (or ``pack_kv``).
:class:`InProcessKvTransfer` is the in-process implementation used in tests and
single-process setups; it chunks and reassembles frames exactly like the
network path so the same :class:`~pdserve.engine.kv.codec.KvLimits` apply.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pdserve.engine.kv.codec import Frame, KvCodecError, KvLimits
from pdserve.engine.kv.framing import DEFAULT_CHUNK_BYTES, FrameAssembler, iter_chunks


class KvTransferError(RuntimeError):
    """A KV frame could not be delivered or was rejected by the receiving side.

    ``code``: a gRPC status code name for why (the transport's, or the receiver's refusal;
    "INTERNAL" by default); ``reason``: the cause in words without the target's address (default:
    the message).
    """

    def __init__(self, message: str, code: str = "INTERNAL", reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = message if reason is None else reason


@runtime_checkable
class KvReceiver(Protocol):
    async def receive_kv(self, frame: Frame) -> None:
        """Accept one complete frame (one buffer or its consecutive parts, e.g. the received chunks).

        Raises KvCodecError for a frame that cannot be accepted, KeyError for an
        unknown request id, or whatever else the implementation decides.
        """
        ...


@runtime_checkable
class KvSender(Protocol):
    async def send_kv(self, target: str, request_id: str, frame: Frame) -> None:
        """Deliver ``frame`` (for ``request_id``; one buffer or its parts as from ``encode_kv``) to the
        decode worker at ``target`` ("host:port").

        Raises KvTransferError on any failure, including rejection by the receiver.
        """
        ...


class InProcessKvTransfer:
    """KvSender delivering to receivers registered in this process.

    Every frame is split with :func:`iter_chunks` into ``chunk_bytes`` pieces
    and reassembled with a :class:`FrameAssembler` bounded by ``limits`` before
    the receiver sees it.  ``chunks_sent`` counts chunks over the lifetime of
    the object.  Raises ValueError if ``chunk_bytes <= 0``.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, limits: KvLimits = KvLimits()):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.limits = limits
        self.chunks_sent = 0
        self._receivers: dict[str, KvReceiver] = {}

    def register(self, target: str, receiver: KvReceiver) -> None:
        """Route frames sent to ``target`` to ``receiver`` (replacing any previous one)."""
        self._receivers[target] = receiver

    async def send_kv(self, target: str, request_id: str, frame: Frame) -> None:
        """Chunk, reassemble and hand ``frame`` to the receiver registered for ``target``.

        Raises KvTransferError if ``target`` is unknown, if reassembly exceeds
        ``limits`` (cause: KvCodecError), or if the receiver raises (the
        receiver's exception is chained as ``__cause__``).
        """
        receiver = self._receivers.get(target)
        if receiver is None:
            raise KvTransferError(f"unknown kv target {target!r} for request {request_id!r}")
        assembler = FrameAssembler(self.limits)
        try:
            for chunk in iter_chunks(frame, self.chunk_bytes):
                assembler.add(chunk)
                self.chunks_sent += 1
        except KvCodecError as e:
            raise KvTransferError(f"kv frame for request {request_id!r} refused in transit: {e}") from e
        try:
            await receiver.receive_kv(assembler.parts())
        except Exception as e:
            raise KvTransferError(f"{target} rejected kv for request {request_id!r}: {type(e).__name__}: {e}") from e
