"""Decode role: receives KV caches, continues sequences in its continuous batch, streams tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.decode_worker.layer_writer import LayerWriter
from pdserve.engine.config import for_role
from pdserve.engine.kv.buffers import HostBuffers
from pdserve.engine.kv.codec import Buffer, Frame, KvCodecError, KvLimits, KvPayload, unpack_kv
from pdserve.engine.kv.stream_decoder import KvStreamDecoder
from pdserve.engine.llm_engine import KvCacheFullError, LLMEngine
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.host import EngineHost, relay_tokens, run_or_undo, submit_quietly

ADMIT_RETRY_S = 0.005
ADMIT_PREEMPT_AFTER_S = 1.0  # a KV kept out this long by a full cache preempts running sequences for its room
CACHED_TOKENS_KEY = "x-pdserve-cached-tokens"  # Decode's initial metadata: prompt tokens held for the KV
PUSH_ERROR_CODES = (
    (KvCodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KvCacheFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


class DecodeWorker(worker_pb2_grpc.DecodeServiceServicer):
    """Composes an EngineHost (engine + its thread); implements ``pdserve.engine.kv.transfer.KvReceiver``.

    A request is attached by ``Decode`` (the router calls it before prefill); its KV arrives through
    ``PushKv`` within ``kv_timeout_s`` seconds or the stream fails with DEADLINE_EXCEEDED. Given the
    prompt, ``Decode`` first holds its cached prefix (``LLMEngine.pin_prefix``) and says how many
    tokens that is, so the push can leave them out. KV for a
    request nobody waits for is refused before it is assembled, so no block is ever allocated for it.
    """

    role = "decode"

    def __init__(
        self,
        engine: LLMEngine,
        kv_timeout_s: float = 30.0,
        limits: KvLimits = KvLimits(),
        host: EngineHost | None = None,
    ) -> None:
        """``host``: an EngineHost shared with other services (a switchable worker); default: its own."""
        self.engine = engine
        self.kv_timeout_s = kv_timeout_s
        self.limits = limits
        self.kv_buffers = HostBuffers()  # tensors of admitted KV, reused by the next pushes
        self.host = host or EngineHost(engine, extra_stats=lambda: {"num_awaiting_kv": self.num_awaiting_kv()})
        self._pending: dict[str, asyncio.Future] = {}
        self._kv_transfer: dict[str, tuple[int, int, int]] = {}  # request id -> (ns, bytes, admission ns)

    def num_awaiting_kv(self) -> int:
        """Decode streams still waiting for their KV."""
        return sum(1 for f in list(self._pending.values()) if not f.done())

    async def receive_kv(self, frame: Frame) -> None:
        """Unpack, check and admit a KV frame, one buffer or its received chunks (KvReceiver).

        Raises KvCodecError for a bad frame, KeyError when no Decode stream waits for its request,
        ValueError when the request can never fit, KvCacheFullError when blocks stay short past the
        KV timeout. A KV that a full cache (or sequences waiting here to be recomputed) keeps out
        for ``ADMIT_PREEMPT_AFTER_S`` seconds is admitted by preempting the running sequences
        holding the most blocks, which this worker recomputes later: a loaded decode worker slows
        down but does not fail the request. The waiting Decode stream gets the same error.
        """
        await self.admit(await asyncio.to_thread(unpack_kv, frame, self.engine.fingerprint, self.limits))

    async def admit(self, payload: KvPayload) -> None:
        """Admit an unpacked KV payload for its waiting Decode stream (errors as :meth:`receive_kv`)."""
        start = time.monotonic()
        seq = await self._place(payload.request_id, lambda e, preempt: e.admit_kv(payload, preempt), False)
        if seq is not None:
            self._admitted(seq, payload.first_token_unix_ns, payload.kv.nbytes, start)

    async def _place(self, rid: str, place, reserve: bool) -> Sequence | None:
        """Run ``place(engine, preempt)`` (``admit_kv`` or ``reserve_kv``) on the engine thread until
        blocks are free (the retries and preemption of :meth:`receive_kv`); the sequence, or None when
        the Decode stream went away meanwhile (what was placed is let go again)."""
        fut = self._pending.get(rid)
        if fut is None or fut.done():
            raise KeyError(f"no decode stream is waiting for request {rid!r}")
        start = time.monotonic()
        deadline = start + self.kv_timeout_s
        while True:
            preempt = time.monotonic() - start > ADMIT_PREEMPT_AFTER_S
            try:
                seq = await run_or_undo(
                    self.host.loop, lambda e, preempt=preempt: place(e, preempt), lambda e, seq: e.release_kv(seq)
                )
                break
            except KvCacheFullError as exc:
                if fut.done() or time.monotonic() > deadline:
                    err = KvCacheFullError(f"KV cache full for {self.kv_timeout_s:.0f}s: {exc}")
                    if not fut.done():
                        fut.set_exception(err)
                    raise err from exc
                await asyncio.sleep(ADMIT_RETRY_S)
            except ValueError as exc:
                if not fut.done():
                    fut.set_exception(exc)
                raise
        if fut.done():  # the stream went away while we were admitting
            await submit_quietly(self.host.loop, lambda e: e.release_kv(seq))
            return None
        return seq

    def _admitted(self, seq: Sequence, sent_ns: int, nbytes: int, start: float) -> None:
        """``seq`` runs: note its transfer timings and let its Decode stream go on."""
        since_admission_ns = time.monotonic_ns() - seq.arrival_ns  # decode time already counts it
        self._kv_transfer[seq.request_id] = (
            max(0, time.time_ns() - sent_ns - since_admission_ns) if sent_ns else 0,
            nbytes,
            int((time.monotonic() - start) * 1e9),
        )
        self._pending[seq.request_id].set_result(seq)

    def _timings(self, seq: Sequence, end_ns: int) -> generate_pb2.Timings:
        ns, nbytes, admission_ns = self._kv_transfer.get(seq.request_id, (0, 0, 0))
        return generate_pb2.Timings(
            kv_transfer_ns=ns,
            kv_transfer_bytes=nbytes,
            decode_ns=end_ns - seq.arrival_ns,
            kv_admission_ns=admission_ns,
            num_preemptions=seq.num_preemptions,
            preempted_ns=seq.preempted_ns,
        )

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            q = self.host.streams.open(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        timeout = request.kv_timeout_s or self.kv_timeout_s
        finished = False
        try:
            cached = 0
            if request.prompt_token_ids:  # hold the cached prefix: the push may leave it out
                prompt = list(request.prompt_token_ids)
                cached = await asyncio.wrap_future(self.host.loop.submit(lambda e: e.pin_prefix(rid, prompt)))
            await context.send_initial_metadata(((CACHED_TOKENS_KEY, str(cached)),))
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except asyncio.TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no KV cache arrived for request {rid!r} within {timeout:.1f}s"
                )
            except KvCodecError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV cache refused: {exc}")
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except KvCacheFullError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Exception as exc:
                await context.abort(grpc.StatusCode.INTERNAL, f"KV cache admission failed: {exc!r}")
            side = self.host.channels.sender(request.token_channel, rid)
            async for batch in relay_tokens(q, context, self._timings, side):
                finished = batch.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                yield batch
        finally:
            if not fut.done():
                fut.cancel()
            self._pending.pop(rid, None)
            self._kv_transfer.pop(rid, None)
            self.host.streams.close(rid)
            # one call: a cancellation arriving while it is under way cannot skip the abort
            await submit_quietly(self.host.loop, lambda e: _let_go(e, rid, finished))

    async def PushKv(self, request_iterator, context: grpc.aio.ServicerContext) -> worker_pb2.PushKvResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "KV cache refused: the push carried no chunk")

        async def data():
            yield first.data
            async for chunk in request_iterator:
                yield chunk.data

        try:
            received = await self.take_push(first.request_id, data())
        except KvPushRefused as exc:
            await context.abort(exc.code, exc.message)
        return worker_pb2.PushKvResponse(received_bytes=received)

    async def take_push(self, rid: str, data: AsyncIterator[Buffer]) -> int:
        """Take one push of ``rid``'s KV, whatever carried it (gRPC's PushKv, the KV data connection
        of ``decode_worker.kv_tcp``): ``data`` yields its bytes in pieces of any size. Returns the
        bytes received.

        The pieces are decoded as they arrive: a bad header is refused at once, and each piece is
        checksummed and copied while the next ones are still in flight. A whole frame is admitted
        once it is in; a layer-wise stream has its blocks reserved at its head frame, each layer
        written into them as it lands and the sequence admitted at its end frame (LayerWriter).
        Raises KvPushRefused (NOT_FOUND when no Decode stream waits for ``rid``; the
        ``PUSH_ERROR_CODES`` code of any other failure, which also ends the waiting Decode stream).
        However the push ends (refused, cut short, cancelled) it leaves no block behind.
        """
        if rid not in self._pending:
            raise KvPushRefused(grpc.StatusCode.NOT_FOUND, f"no decode stream is waiting for request {rid!r}")
        decoder = KvStreamDecoder(self.engine.fingerprint, self.limits, self.kv_buffers.take)
        writer = LayerWriter(self)
        try:
            async for piece in data:
                for event in decoder.add(piece):
                    if not await writer.on_event(rid, event):
                        return decoder.received
            payload = decoder.finish()
            if payload is not None:
                await self.admit(payload)
                self.kv_buffers.give(payload.kv)  # written into the cache (admit_kv has returned)
        except Exception as exc:  # every failure also ends the waiting Decode stream at once
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
            code = next((c for t, c in PUSH_ERROR_CODES if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
            message = exc.args[0] if isinstance(exc, KeyError) else str(exc) or repr(exc)
            raise KvPushRefused(code, f"KV cache refused: {message}") from exc
        finally:  # a stream that broke off (cancelled, refused, cut short) leaves no block behind
            writer.release()
        return decoder.received


class KvPushRefused(Exception):
    """A decode worker did not take a KV push: ``code`` (a grpc.StatusCode) and ``message`` say why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _let_go(engine: LLMEngine, request_id: str, finished: bool) -> None:
    """A Decode stream ended: release the prefix held for its KV and, unless it finished, abort it."""
    engine.unpin(request_id)
    if not finished:
        engine.abort(request_id)


def decode_service(worker: DecodeWorker) -> tuple:
    """DecodeService on ``worker``, as ``serve_worker`` takes services."""
    return (worker_pb2_grpc.add_DecodeServiceServicer_to_server, worker, "pdserve.v1.DecodeService")


async def serve(cfg, host: str = "127.0.0.1", port: int = 0, kv_timeout_s: float = 30.0):
    """Build the engine (off the event loop) and serve DecodeService + WorkerService, and
    ColocatedService on the same engine for requests the router has it prefill itself
    (conditional disaggregation), and the KV data connection (``decode_worker.kv_tcp``).

    Returns a ``pdserve.worker.host.RunningWorker``; ``port=0`` picks a free port.
    """
    from pdserve.worker.host import serve_worker

    engine = await asyncio.to_thread(LLMEngine, for_role(cfg, "decode"))
    from pdserve.decode_worker.kv_tcp import KvTcpServer
    from pdserve.worker.colocated_service import ColocatedWorker, colocated_service

    worker = DecodeWorker(engine, kv_timeout_s)
    local = ColocatedWorker(engine, worker.host)
    services = [decode_service(worker), colocated_service(local)]
    return await serve_worker(worker, services, host, port, KvTcpServer(worker))
