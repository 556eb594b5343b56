"""The client-facing GenerateService: validate, route, relay tokens, detokenize, finish."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.engine.config import ModelConfig
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.host.serving import start_server
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.proto.v1 import generate_pb2, generate_pb2_grpc
from pdserve.router.backends import ColocatedBackend, RequestState, SplitBackend
from pdserve.router.pool import NoWorkerAvailable, WorkerPool
from pdserve.router.validation import InvalidRequest, validate

log = logging.getLogger(__name__)
PB = generate_pb2


class RouterServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Implements pdserve.v1.GenerateService over a WorkerPool.

    Errors: INVALID_ARGUMENT for a bad request, ALREADY_EXISTS for a request id already in flight,
    UNAVAILABLE when no worker of a needed role is healthy, and the worker's status code when a
    worker call fails before anything was streamed; after that, the failure is sent as the stream's
    last message (``Error``).
    """

    def __init__(self, model_dir: Path, pool: WorkerPool, max_model_len: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_folder(model_dir)
        cfg = ModelConfig.from_folder(model_dir)
        self.vocab_size = cfg.vocab_size
        limits = [cfg.max_position_embeddings, max_model_len, pool.kv_capacity_tokens()]
        self.max_model_len = min(x for x in limits if x)  # a request must fit the context and a KV cache
        self.pool = pool
        self.backend = ColocatedBackend(pool) if pool.placement == "colocated" else SplitBackend(pool)
        self.inflight: dict[str, RequestState] = {}

    async def Generate(self, request: PB.GenerateRequest, context: grpc.aio.ServicerContext):
        t0 = time.monotonic_ns()
        try:
            # tokenizing a huge prompt takes seconds: keep the event loop serving other clients
            req = await asyncio.to_thread(validate, request, self.tokenizer, self.max_model_len, self.vocab_size)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if req.request_id in self.inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {req.request_id!r} is already in flight")
        state = RequestState()
        self.inflight[req.request_id] = state
        detok = IncrementalDetokenizer(self.tokenizer, req.stop)
        usage = PB.Usage(prompt_tokens=len(req.prompt_token_ids))
        finish, timings, streamed = PB.FINISH_REASON_UNSPECIFIED, PB.Timings(), False
        events = self.backend.stream(req, state, t0, context.time_remaining())
        try:
            async for ev in events:
                usage.completion_tokens += len(ev.token_ids)
                text = detok.add(ev.token_ids)
                streamed = True
                yield PB.GenerateResponse(chunk=PB.Chunk(token_ids=ev.token_ids, text=text, usage=usage))
                if detok.stopped:
                    finish = PB.FINISH_REASON_STOP
                    break
                if ev.finish:
                    finish, timings = ev.finish, ev.timings
                    break
        except NoWorkerAvailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if not state.aborted:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                message = f"worker failed: {exc.details()}"
                log.warning("request %s: %s %s", req.request_id, exc.code().name, message)
                if not streamed:
                    await context.abort(exc.code(), message)
                yield PB.GenerateResponse(error=PB.Error(code=exc.code().name, message=message, usage=usage))
                return
            finish = PB.FINISH_REASON_ABORT
        finally:
            await events.aclose()
            self.inflight.pop(req.request_id, None)
        rest = "" if detok.stopped or finish == PB.FINISH_REASON_ABORT else detok.finish()
        timings.total_ns = time.monotonic_ns() - t0
        yield PB.GenerateResponse(complete=PB.Complete(finish_reason=finish, usage=usage, text=rest,
                                                       timings=timings, request_id=req.request_id))

    async def Abort(self, request: PB.AbortRequest, context) -> PB.AbortResponse:
        state = self.inflight.get(request.request_id)
        if state is not None:
            state.abort()
        return PB.AbortResponse(aborted=state is not None)

    async def GetModelInfo(self, request, context) -> PB.ModelInfo:
        return PB.ModelInfo(
            model=str(self.model_dir), max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids), placement=self.pool.placement,
            workers=[PB.WorkerInfo(role=w.role, address=w.address) for w in self.pool.workers])


@dataclass
class RunningRouter:
    servicer: RouterServicer
    server: grpc.aio.Server
    address: str

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.server.stop(grace_s)
        await self.servicer.pool.close()


async def serve(model_dir: Path, prefill: list[str] = (), decode: list[str] = (), both: list[str] = (),
                host: str = "127.0.0.1", port: int = 0, max_model_len: int | None = None) -> RunningRouter:
    """Start the router for a split (``prefill`` + ``decode``) or colocated (``both``) pool.

    ValueError when the pool is neither split nor colocated.
    """
    if both and (prefill or decode):
        raise ValueError("give either prefill + decode workers (split) or colocated workers, not both")
    if not both and not (prefill and decode):
        raise ValueError("split placement needs at least one prefill and one decode worker")
    pool = WorkerPool(list(prefill), list(decode), list(both))
    await pool.start()
    servicer = RouterServicer(model_dir, pool, max_model_len)
    server, bound = await start_server(
        [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, servicer, "pdserve.v1.GenerateService")],
        host, port)
    return RunningRouter(servicer, server, f"{host}:{bound}")
