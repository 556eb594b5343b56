"""Prefill role: batches prompts, returns the first token, pushes the KV cache to a decode worker."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from pdserve.engine.config import KV_STREAMS, for_role
from pdserve.engine.kv.buffers import HostBuffers
from pdserve.engine.kv.codec import KvCodecError, KvPayload, encode_kv
from pdserve.engine.kv.layer_frames import (
    KvStreamHead,
    LayerKv,
    encode_end,
    encode_head,
    encode_layer,
    stream_frames,
)
from pdserve.engine.kv.transfer import KvSender, KvTransferError
from pdserve.engine.llm_engine import LLMEngine, StepOutput
from pdserve.engine.scheduling.sequence import FinishReason
from pdserve.prefill_worker.layer_stream import LayerStreamer
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.host import FINISH_TO_PROTO, EngineHost, ErrorEvent, abort_quietly, admit_prompt

log = logging.getLogger(__name__)


@dataclass
class PrefillDone:
    """First token of a request; ``payload`` is None when that token already finished it."""

    token: int
    finish: FinishReason | None
    payload: KvPayload | None
    queue_ns: int
    prefill_ns: int
    first_token_unix_ns: int
    cached_prompt_tokens: int = 0
    streamed: bool = False  # its KV went layer by layer; the push ends with this token


class PrefillWorker(worker_pb2_grpc.PrefillServiceServicer):
    """Composes an EngineHost (engine + its thread) and a KvSender.

    After each prefill step every sequence leaves the engine at once, so its blocks are free before
    the next step and this engine never runs a decode step. ``kv_stream`` says how its KV goes:
    "whole": after the step, as one frame (``LLMEngine.extract_kv``; copied into host buffers that
    are reused once a push succeeded, ``kv_buffers``; a hybrid model's as one round of layer frames,
    so that its windowed layers send only their window); "layer": layer by layer while the forward
    runs (``layer_stream.LayerStreamer``, the runner's layer hook), in one PushKv call opened when
    its prefill starts (``kv_sender.send_kv_stream``, which ``GrpcKvSender`` has).
    """

    role = "prefill"

    def __init__(
        self, engine: LLMEngine, kv_sender: KvSender, host: EngineHost | None = None, kv_stream: str | None = None
    ) -> None:
        """``host``: an EngineHost shared with other services (a switchable worker), whose outputs
        callback hands this one the outputs of ``request_ids``; default: its own. ``kv_stream``:
        default ``engine.cfg.kv_stream``; ValueError for one not in ``KV_STREAMS``."""
        kv_stream = kv_stream or engine.cfg.kv_stream
        if kv_stream not in KV_STREAMS:
            raise ValueError(f"kv_stream must be one of {', '.join(KV_STREAMS)}, got {kv_stream!r}")
        self.engine = engine
        self.kv_sender = kv_sender
        self.kv_buffers = HostBuffers()
        self.streamer = LayerStreamer(engine) if kv_stream == "layer" else None
        if self.streamer is not None:
            engine.runner.layer_hook = self.streamer
        self.host = host or EngineHost(engine, self.on_outputs)
        self.request_ids: set[str] = set()  # Prefill calls under way
        self._kv_skip: dict[str, int] = {}  # request id -> prompt tokens its decode worker holds
        self._pushes: set[asyncio.Task] = set()

    def on_outputs(self, outputs: list[StepOutput]) -> None:  # engine thread
        wall = time.time_ns()
        for out in outputs:
            seq = out.seq
            skip = self._kv_skip.pop(seq.request_id, 0)
            streamed = False
            if self.streamer is not None and self.streamer.streaming(seq.request_id):
                streamed = not seq.is_finished and self.streamer.end(seq.request_id, out.token, wall)
                payload = None
                if not seq.is_finished:
                    self.engine.scheduler.finish(seq)  # its KV is on its way: free its blocks
            else:
                payload = None if seq.is_finished else self.engine.extract_kv(seq, self.kv_buffers.take, skip)
            if payload is not None:
                payload.first_token_unix_ns = wall
            self.host.streams.put(
                seq.request_id,
                PrefillDone(
                    out.token,
                    seq.finish_reason,
                    payload,
                    seq.prefill_start_ns - seq.arrival_ns,
                    seq.prefill_end_ns - seq.prefill_start_ns,
                    wall,
                    seq.num_cached_tokens,
                    streamed,
                ),
            )

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        """The first token; then, while its KV goes to the decode worker, the stream stays open
        (the KV lease) and ends with a ``kv_push_error`` message when the push failed. A caller
        that goes away does not stop a push under way. A layer-wise push that failed before the
        prefill ended is tried again as a whole frame, unless the decode worker refused it
        (``REFUSALS``: the stream then ends with that refusal); one cut short by the caller going away before
        the first token, or by a first token that finished the request, is cancelled."""
        rid = request.request_id
        push = None
        if self.streamer is not None:  # the push starts now and sends each layer as the prefill computes it
            frames = self.streamer.open(rid, request.kv_skip_tokens)
            push = self._start_push(self._push_stream(request.decode_address, rid, frames))
        elif request.kv_skip_tokens:
            self._kv_skip[rid] = request.kv_skip_tokens  # read on the engine thread when the prefill ends
        self.request_ids.add(rid)
        streamed = False
        try:
            q = await admit_prompt(self.host, request, context)
            done = await q.get()
            streamed = isinstance(done, PrefillDone) and done.streamed
        except asyncio.CancelledError:
            await abort_quietly(self.host.loop, rid)
            raise
        finally:
            self.request_ids.discard(rid)
            self._kv_skip.pop(rid, None)
            self.host.streams.close(rid)
            if self.streamer is not None:
                self.streamer.close(rid)
            refused = None
            if push is not None and not streamed:  # no end frame will come: the decode worker frees its blocks
                refused = _refusal(push)
                push.cancel()
                push = None
        if isinstance(done, ErrorEvent):
            await context.abort(grpc.StatusCode.INTERNAL, done.message)
        if done.payload is not None and refused is not None:  # it would refuse the whole frame too
            self.kv_buffers.give(done.payload.kv)
        elif done.payload is not None:
            push = self._start_push(self._push(request.decode_address, done.payload))
        finish = FINISH_TO_PROTO[done.finish] if done.finish else generate_pb2.FINISH_REASON_UNSPECIFIED
        yield worker_pb2.PrefillResponse(
            first_token=done.token,
            finish_reason=finish,
            queue_ns=done.queue_ns,
            prefill_ns=done.prefill_ns,
            first_token_unix_ns=done.first_token_unix_ns,
            cached_prompt_tokens=done.cached_prompt_tokens,
        )
        failure = refused if push is None else await asyncio.shield(push)
        if failure is not None:
            yield worker_pb2.PrefillResponse(kv_push_error=failure)

    def _start_push(self, coro) -> asyncio.Task:
        push = asyncio.create_task(coro)
        self._pushes.add(push)
        push.add_done_callback(self._pushes.discard)
        return push

    async def _push_stream(self, target: str, request_id: str, items: asyncio.Queue) -> worker_pb2.KvPushError | None:
        """Send the layer-wise stream whose items ``items`` receives (``LayerStreamer``) to the decode
        worker at ``target``, each frame as soon as its item arrives; returns as :meth:`_push`."""
        digest, unencodable = self.engine.fingerprint.digest(), []
        first = await items.get()  # the head: the call (and its deadline) starts with the prefill, not in the queue

        async def frames():
            item = first
            while True:
                try:
                    if isinstance(item, KvStreamHead):
                        yield encode_head(item)
                    elif isinstance(item, LayerKv):
                        yield encode_layer(request_id, digest, item.layer, item.start, item.kv)
                    else:
                        yield encode_end(request_id, digest, item.first_token, item.first_token_unix_ns)
                        return
                except KvCodecError as exc:  # the stream stops short: the decode worker refuses it
                    unencodable.append(exc)
                    return
                item = await items.get()

        try:
            await self.kv_sender.send_kv_stream(target, request_id, frames())
        except KvTransferError as exc:
            if not unencodable:
                log.warning("%s", exc)
                return worker_pb2.KvPushError(code=exc.code, message=exc.reason)
        finally:
            self.streamer.close(request_id)
        if unencodable:
            exc = unencodable[0]
            log.error("the KV of request %r could not be serialized: %s", request_id, exc)
            return worker_pb2.KvPushError(code="INTERNAL", message=f"the KV could not be serialized: {exc!r}")
        return None

    async def _push(self, target: str, payload: KvPayload) -> worker_pb2.KvPushError | None:
        """Serialize off the event loop, then stream to the decode worker at ``target``: one frame,
        or for a hybrid model (``LLMEngine.runner.kv_groups``) the frames of one layer-wise round.

        Returns None once the decode worker holds the KV, else why not (also logged): the push's
        status code and reason, or INTERNAL when the KV could not be serialized.
        """
        # a hybrid model's windowed layers send only their window: the frames of one layer-wise round
        windowed = self.engine.runner.kv_groups.num_groups > 1 and hasattr(self.kv_sender, "send_kv_stream")
        try:
            frame = await asyncio.to_thread(stream_frames if windowed else encode_kv, payload)
        except Exception as exc:  # no push can deliver this payload
            log.exception("the KV of request %r could not be serialized", payload.request_id)
            return worker_pb2.KvPushError(code="INTERNAL", message=f"the KV could not be serialized: {exc!r}")
        try:
            if windowed:
                await self.kv_sender.send_kv_stream(target, payload.request_id, _frames(frame))
            else:
                await self.kv_sender.send_kv(target, payload.request_id, frame)
        except KvTransferError as exc:  # after a failure, let the tensor go: the call may still hold it
            log.warning("%s", exc)
            return worker_pb2.KvPushError(code=exc.code, message=exc.reason)
        self.kv_buffers.give(payload.kv)  # the call is over: nothing reads the tensor any more
        return None


async def _frames(frames: list):
    for frame in frames:
        yield frame


# a decode worker that answered a KV push with these refused it (another model, a bad KV, no stream
# waiting, its cache full too long): sending the same KV again as a whole frame cannot help
REFUSALS = frozenset(
    {"FAILED_PRECONDITION", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
    | {"PERMISSION_DENIED", "UNAUTHENTICATED"}
)


def _refusal(push: asyncio.Task) -> worker_pb2.KvPushError | None:
    """The failure of a layer-wise push that already ended because its decode worker refused it."""
    if not push.done() or push.cancelled():
        return None
    failure = push.result()
    return failure if failure is not None and failure.code in REFUSALS else None


def kv_sender_for(cfg, grpc_chunk_bytes: int = 1 << 20) -> KvSender:
    """The KvSender ``cfg.kv_transport`` names: TcpKvSender (with gRPC for workers without a KV port)
    or GrpcKvSender; ``grpc_chunk_bytes``: the size of gRPC's KvChunk messages."""
    from pdserve.prefill_worker.kv_sender import GrpcKvSender
    from pdserve.prefill_worker.kv_tcp_sender import TcpKvSender

    sender = GrpcKvSender(grpc_chunk_bytes)
    return TcpKvSender(sender) if cfg.kv_transport == "tcp" else sender


def prefill_service(worker: PrefillWorker) -> tuple:
    """PrefillService on ``worker``, as ``serve_worker`` takes services."""
    return (worker_pb2_grpc.add_PrefillServiceServicer_to_server, worker, "pdserve.v1.PrefillService")


async def serve(cfg, host: str = "127.0.0.1", port: int = 0, kv_chunk_bytes: int = 1 << 20):
    """Build the engine (off the event loop) and serve PrefillService + WorkerService; the KV
    hand-off is ``cfg.kv_stream``'s, over ``cfg.kv_transport``.

    Returns a ``pdserve.worker.host.RunningWorker``; ``port=0`` picks a free port.
    """
    from pdserve.worker.host import serve_worker

    engine = await asyncio.to_thread(LLMEngine, for_role(cfg, "prefill"))
    worker = PrefillWorker(engine, kv_sender_for(cfg, kv_chunk_bytes))
    return await serve_worker(worker, [prefill_service(worker)], host, port)
