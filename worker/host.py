"""Pieces every worker role composes: token events, the WorkerService servicer, stream relay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pdserve.engine.llm_engine import LLMEngine, StepError, StepOutput
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import FinishReason, Sequence
from pdserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.loop import EngineLoop
from pdserve.worker.streams import RequestStreams, drain
from pdserve.worker.token_channel import TokenChannels

FINISH_TO_PROTO = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}


@dataclass
class TokenEvent:
    """A sampled token; ``finish`` is set when it is the last one."""

    token: int
    finish: FinishReason | None
    seq: Sequence
    at_ns: int


@dataclass
class ErrorEvent:
    """The request failed inside the engine."""

    message: str


def sampling_from_proto(s: worker_pb2.ResolvedSampling) -> SamplingParams:
    """ValueError (readable) for invalid values."""
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        max_tokens=s.max_tokens,
        ignore_eos=s.ignore_eos,
        step_offset=s.step_offset,
    )


def publish_outputs(streams: RequestStreams, outputs: list[StepOutput]) -> None:
    """Engine-thread callback: one TokenEvent per output into its request's stream, the whole step
    handed to the event loop at once."""
    now = time.monotonic_ns()
    streams.put_many([(o.seq.request_id, TokenEvent(o.token, o.seq.finish_reason, o.seq, now)) for o in outputs])


def publish_step_error(streams: RequestStreams, err: StepError) -> None:
    """Engine-thread callback: fail every request of the failed step."""
    for seq in err.seqs:
        streams.put(seq.request_id, ErrorEvent(str(err)))


async def relay_tokens(
    q: asyncio.Queue,
    context: grpc.aio.ServicerContext,
    final_timings: Callable[[Sequence, int], generate_pb2.Timings],
    side: Callable[[int, list[int]], bool] | None = None,
) -> AsyncIterator[worker_pb2.TokenBatch]:
    """Turn a request's events into TokenBatch messages until its last token.

    Tokens already queued are coalesced into one message. ``final_timings(seq, end_ns)`` fills the
    last message's timings, and the first message's with the phases known by then (queue, prefill,
    KV transfer; decode so far), so a client that stops reading early (a stop string matched by
    the router) still has them. An ErrorEvent aborts the RPC with INTERNAL. ``side`` (a token
    channel's sender, worker/token_channel.py) takes the batches between the first and the last
    when it can; each batch says the index of its first token (``first_index``).
    """
    sent = 0  # tokens sent so far, on the call or the side channel
    while True:
        events = await drain(q)
        tokens = []
        for ev in events:
            if isinstance(ev, ErrorEvent):
                await context.abort(grpc.StatusCode.INTERNAL, ev.message)
            tokens.append(ev.token)
            if ev.finish is not None:
                yield worker_pb2.TokenBatch(
                    token_ids=tokens,
                    first_index=sent,
                    finish_reason=FINISH_TO_PROTO[ev.finish],
                    timings=final_timings(ev.seq, ev.at_ns),
                )
                return
        if not (sent and side is not None and side(sent, tokens)):
            last = events[-1]
            timings = final_timings(last.seq, last.at_ns) if not sent else None
            yield worker_pb2.TokenBatch(token_ids=tokens, first_index=sent, timings=timings)
        sent += len(tokens)


class EngineHost:
    """An LLMEngine on its own thread (EngineLoop) plus the per-request streams its outputs feed.

    Every role composes one. ``on_outputs`` defaults to publishing each token as a TokenEvent;
    ``extra_stats()`` adds role-specific WorkerStats fields.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[StepOutput]], None] | None = None,
        extra_stats: Callable[[], dict] = dict,
    ) -> None:
        from pdserve.worker.step_trace import attach

        self.engine = engine
        attach(engine)
        self.loop = EngineLoop(engine, on_outputs or self.publish, self._on_step_error)
        self.extra_stats = extra_stats
        self.streams: RequestStreams | None = None
        self.channels = TokenChannels()

    def start(self) -> None:
        """Start the engine thread; call from the event loop that serves gRPC."""
        self.streams = RequestStreams(asyncio.get_running_loop())
        self.loop.start()

    async def stop(self) -> None:
        self.loop.stop()

    def publish(self, outputs: list[StepOutput]) -> None:  # engine thread
        publish_outputs(self.streams, outputs)

    def _on_step_error(self, err: StepError) -> None:  # engine thread
        publish_step_error(self.streams, err)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """GetStats, Abort, SetRole and TokenChannel for any role: ``worker.role`` is read at each call (a switchable
    worker's changes); ``worker.host.extra_stats()`` adds role-specific fields; SetRole calls
    ``worker.set_role(role)`` (returns the previous role; ValueError for an unknown one) and is
    FAILED_PRECONDITION on a worker without it. GetStats names ``kv_tcp``'s port while it listens."""

    def __init__(self, worker, kv_tcp=None) -> None:
        self.worker, self.kv_tcp = worker, kv_tcp
        self.loop: EngineLoop = worker.host.loop

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        # read directly: going through the engine thread would wait out a long prefill step
        w = self.worker
        stats = self.loop.engine.stats() | w.host.extra_stats()
        port = self.kv_tcp.port if self.kv_tcp is not None else 0
        return worker_pb2.WorkerStats(role=w.role, kv_tcp_port=port, **stats)

    async def SetRole(self, request, context) -> worker_pb2.SetRoleResponse:
        set_role = getattr(self.worker, "set_role", None)
        if set_role is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this {self.worker.role} worker has a fixed role; only switchable workers (--placement auto) switch",
            )
        try:
            previous = set_role(request.role)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.SetRoleResponse(previous_role=previous, role=self.worker.role)

    async def TokenChannel(self, request, context):
        if not request.channel_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a token channel needs a channel_id")
        channels = self.worker.host.channels
        channel = channels.open(request.channel_id)
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            channels.close(channel)

    async def Abort(self, request, context) -> worker_pb2.WorkerAbortResponse:
        seq = await asyncio.wrap_future(self.loop.submit(lambda e: e.abort(request.request_id)))
        return worker_pb2.WorkerAbortResponse(aborted=seq is not None)


async def admit_prompt(host: EngineHost, request, context: grpc.aio.ServicerContext) -> asyncio.Queue:
    """Queue ``request`` (request_id, prompt_token_ids, sampling) on the engine; returns its event queue.

    Aborts the RPC with INVALID_ARGUMENT (and leaves nothing behind) for bad sampling values, a
    request id already in flight here, or a prompt the engine can never run.
    """
    rid, prompt = request.request_id, list(request.prompt_token_ids)
    try:
        sampling = sampling_from_proto(request.sampling)
        q = host.streams.open(rid)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    try:
        await asyncio.wrap_future(host.loop.submit(lambda e: e.add_request(rid, prompt, sampling)))
    except ValueError as exc:
        host.streams.close(rid)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return q


async def submit_quietly(loop: EngineLoop, fn) -> None:
    """Run ``fn(engine)`` on the engine thread and wait for it; ignores a stopped loop. The call runs
    even when the waiting task is cancelled meanwhile (the cancellation still reaches the caller):
    what goes through here is clean-up, such as an abort or an unpin, that must never be skipped."""
    try:
        await asyncio.shield(asyncio.wrap_future(loop.submit(fn)))
    except RuntimeError:
        pass


async def run_or_undo(loop: EngineLoop, fn, undo):
    """Run ``fn(engine)`` on the engine thread and return its result (its exception raised here).
    When the waiting task is cancelled meanwhile, a call that is not yet running is dropped and one
    that ran anyway is undone: ``undo(engine, result)`` runs after it on the engine thread, so that
    nothing it placed (a sequence, its KV blocks) outlives a caller that never saw it."""
    call = loop.submit(fn)
    try:
        return await asyncio.wrap_future(call)
    except asyncio.CancelledError:
        call.cancel()

        def undo_if_ran(engine):  # runs after ``call`` on the engine thread: it is done or cancelled
            if not call.cancelled() and call.exception() is None:
                undo(engine, call.result())

        loop.submit(undo_if_ran)
        raise


async def abort_quietly(loop: EngineLoop, request_id: str) -> None:
    """Abort a request on the engine (frees its blocks); ignores a stopped loop."""
    await submit_quietly(loop, lambda e: e.abort(request_id))


@dataclass
class RunningWorker:
    """A role object served by a started gRPC server at ``address``."""

    worker: object
    server: grpc.aio.Server
    address: str
    kv_tcp: object | None = None  # the KV data listener (``decode_worker.kv_tcp.KvTcpServer``) of a decode role

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.kv_tcp is not None:
            await self.kv_tcp.stop()
        await self.server.stop(grace_s)
        await self.worker.host.stop()


async def serve_worker(worker, services: list[tuple], host: str, port: int, kv_tcp=None) -> RunningWorker:
    """Start ``worker.host`` and a gRPC server with ``services`` ((add_servicer, servicer, service
    name) triples sharing the same engine) + WorkerService.

    ``worker`` has ``role`` (str) and ``host`` (EngineHost) attributes (see ``WorkerServicer``). With
    a cluster secret in the environment (``auth.SECRET_ENV``), calls without it are UNAUTHENTICATED.
    ``kv_tcp``: a ``KvTcpServer`` to start on ``host`` (a free port), which GetStats then names.
    """
    from pdserve.rpc.auth import cluster_secret, require_cluster_secret
    from pdserve.rpc.server import start_server

    secret = cluster_secret()
    worker.host.start()
    stats = WorkerServicer(worker, kv_tcp)
    if kv_tcp is not None:
        await kv_tcp.start(host)
    server, bound = await start_server(
        [*services, (worker_pb2_grpc.add_WorkerServiceServicer_to_server, stats, "pdserve.v1.WorkerService")],
        host,
        port,
        interceptors=[require_cluster_secret(secret)] if secret else None,
    )
    return RunningWorker(worker, server, f"{host}:{bound}", kv_tcp)
