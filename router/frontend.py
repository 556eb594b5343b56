"""One request's life in the router, shared by the gRPC and the HTTP (OpenAI) front ends:
validate, route, relay tokens, detokenize, finish, and record the request's metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from pdserve.engine.config import ModelConfig
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.backends import ColocatedBackend, RequestState
from pdserve.router.local_prefill import LocalPrefill
from pdserve.router.pool import NoWorkerAvailable, Overloaded, WorkerPool
from pdserve.router.prometheus import RouterMetrics
from pdserve.router.role_balancer import RoleBalancer
from pdserve.router.role_switch import RoleRebalancer
from pdserve.router.split_backend import SplitBackend
from pdserve.router.validation import InvalidRequest, sampling_defaults, validate
from pdserve.rpc.auth import bearer, key_index
from pdserve.v1 import generate_pb2

log = logging.getLogger(__name__)
PB = generate_pb2
SHUTDOWN_MESSAGE = "server shutting down"
# host:port of an internal address in a worker's error text (gRPC names the peer it failed to
# reach): clients see "a worker" instead, the log keeps the address
_ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]|localhost)(?::\d+)?")
STALL_WARN_S = 30.0  # a stream this long without a token is logged and counted (pdserve:stream_stalls_total)


def redact_addresses(text: str) -> str:
    """``text`` with every IP address or host:port in it replaced by "a worker" (internal
    addresses are for the log and the admin view, not for clients)."""
    return _ADDRESS.sub("a worker", text)


class RequestRejected(Exception):
    """The request failed before any token was streamed; ``code`` is the gRPC status it maps to
    (INVALID_ARGUMENT, ALREADY_EXISTS, UNAVAILABLE, or the failing worker's own code); ``param``
    names the request field at fault, when one is (``InvalidRequest.param``)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class Frontend:
    """The model's tokenizer and limits, the worker pool, the requests in flight and the metrics.

    ``max_model_len`` is the smallest of the model's context, the configured limit and the tokens
    the smallest worker KV cache holds: every request must fit all three. ``model_name`` is the id
    clients see and send (default: the model folder's name; never a path).
    ``local_prefill``: when a split (or auto) placement prefills on the decode worker
    (router/local_prefill.py; None: never). With switchable workers (``--placement auto``) a
    ``RoleRebalancer`` (router/role_switch.py) switches their roles as ``role_balancer`` (default
    ``RoleBalancer()``) decides; it runs after each stats poll.
    ``stall_warn_s``: seconds a stream may go without a token (its first included) before
    ``watch_stalls`` logs it and counts it in ``pdserve:stream_stalls_total``.
    ``stream_interval``: tokens per streamed chunk (as vLLM's and SGLang's ``--stream-interval``):
    a stream's first token goes at once, then a chunk every ``stream_interval`` tokens, and what is
    left goes before the stream's end or error. 1 (the default): a chunk for every token batch.
    ValueError when below 1.
    """

    def __init__(
        self,
        model_dir: Path,
        pool: WorkerPool,
        max_model_len: int | None = None,
        metrics: RouterMetrics | None = None,
        api_keys: tuple[str, ...] = (),
        model_name: str | None = None,
        local_prefill: LocalPrefill | None = None,
        role_balancer: RoleBalancer | None = None,
        stall_warn_s: float = STALL_WARN_S,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.tokenizer = Tokenizer.from_folder(model_dir)
        cfg = ModelConfig.from_folder(model_dir)
        self.vocab_size = cfg.vocab_size
        self.sampling_defaults = sampling_defaults(model_dir)
        asked = min(x for x in (cfg.max_position_embeddings, max_model_len) if x)
        kv_tokens = pool.kv_capacity_tokens()
        self.max_model_len = min(asked, kv_tokens) if kv_tokens else asked
        if self.max_model_len < asked:
            log.warning(
                "the smallest worker KV cache holds %d tokens: the context window is %d tokens, not %d "
                "(a larger --kv-cache-gib or --num-kv-blocks raises it)",
                kv_tokens,
                kv_tokens,
                asked,
            )
        self.pool = pool
        self.inflight: dict[str, RequestState] = {}
        self.metrics = metrics or RouterMetrics(pool)
        self.backend = (
            ColocatedBackend(pool)
            if pool.placement == "colocated"
            else SplitBackend(pool, self.metrics.migrations.inc, local_prefill, self.metrics.local_prefilled)
        )
        self.rebalancer = (
            RoleRebalancer(pool, role_balancer, on_switch=self.metrics.role_switched)
            if pool.placement == "auto"
            else None
        )
        self.api_keys = api_keys  # empty: no authentication
        self.shutting_down = False
        self.stall_warn_s = stall_warn_s

    async def watch_stalls(self) -> None:
        """Log and count each stream in flight that has gone ``stall_warn_s`` without a token (once
        per stall), and its recovery; the gauge ``pdserve:streams_stalled`` holds how many are now.
        Run after every stats poll (``WorkerPool.on_refresh``)."""
        now, bound = time.monotonic_ns(), self.stall_warn_s * 1e9
        stalled = 0
        for rid, state in list(self.inflight.items()):
            gap = now - state.last_token_ns
            if gap > bound:
                stalled += 1
                if not state.stalled:
                    state.stalled = True
                    self.metrics.stalls.inc()
                    log.warning("request %s: no token for %.1fs (stall bound %gs)", rid, gap / 1e9, self.stall_warn_s)
        self.metrics.stalled.set(stalled)

    def model_info(self, admin: bool) -> PB.ModelInfo:
        """What the router serves: the model's id and limits, every worker's role and health; the
        model folder and the worker addresses only when ``admin``."""
        return PB.ModelInfo(
            model=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            placement=self.pool.placement,
            model_path=str(self.model_dir) if admin else "",
            workers=[
                PB.WorkerInfo(role=w.role, healthy=w.healthy, address=w.address if admin else "")
                for w in self.pool.workers
            ],
        )

    def owner_of(self, metadata) -> int | None:
        """The index of the API key in ``metadata`` (gRPC metadata or HTTP headers as pairs)."""
        return key_index(self.api_keys, bearer(metadata)) if self.api_keys else None

    async def generate(
        self,
        request: PB.GenerateRequest,
        timeout: float | None,
        owner: int | None = None,
        names: dict[str, str] | None = None,
    ) -> AsyncIterator[PB.GenerateResponse]:
        """The response stream of one request: chunks, then one ``complete`` or ``error`` message.

        ``timeout``: seconds left of the client's deadline (None: none); ``owner``: the caller's
        API key index, which Abort must match; ``names``: the client's names of request fields,
        for errors (``validate``). Raises RequestRejected
        before the first message when the request cannot start; a failure after tokens were
        streamed ends the stream with an ``error`` message instead. Cancelling the consumer cancels
        the worker calls, which free the request's KV blocks.
        """
        t0 = time.monotonic_ns()
        try:
            # tokenizing a huge prompt takes seconds: keep the event loop serving other clients
            req = await asyncio.to_thread(
                validate, request, self.tokenizer, self.max_model_len, self.vocab_size, self.sampling_defaults, names
            )
        except InvalidRequest as exc:
            self.metrics.rejected("invalid")
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.param) from None
        except asyncio.CancelledError:  # the client went away while its prompt was tokenized
            self.metrics.finished(PB.FINISH_REASON_ABORT, t0, None)
            raise
        if self.shutting_down:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        if req.request_id in self.inflight:
            self.metrics.rejected("invalid")
            raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS, f"request id {req.request_id!r} is already in flight")
        state = RequestState(owner=owner)
        self.inflight[req.request_id] = state
        detok = IncrementalDetokenizer(self.tokenizer, req.stop)
        usage = PB.Usage(prompt_tokens=len(req.prompt_token_ids))
        finish, timings, last_ns, first_ns = PB.FINISH_REASON_UNSPECIFIED, PB.Timings(), None, None
        timings_ns = None  # when the latest timings arrived, while they are not the worker's final ones
        held = PB.Chunk()  # tokens and text not streamed yet (stream_interval)
        events = self.backend.stream(req, state, t0, timeout)
        try:
            async for ev in events:
                now = time.monotonic_ns()
                self.metrics.token_arrival(now - (last_ns or t0), first=last_ns is None)
                first_ns = first_ns or now
                if state.stalled:
                    state.stalled = False
                    self.metrics.stalled.dec()  # now, not at the next poll: the stream may end before it
                    log.warning(
                        "request %s: a token again after %.1fs", req.request_id, (now - state.last_token_ns) / 1e9
                    )
                last_ns = state.last_token_ns = now
                usage.completion_tokens += len(ev.token_ids)
                if ev.timings is not None:  # phases known so far survive a stop string's early end
                    timings, timings_ns = ev.timings, (None if ev.finish else now)
                held.token_ids.extend(ev.token_ids)
                held.text += detok.add(ev.token_ids)
                first = usage.completion_tokens == len(held.token_ids)
                if first or ev.finish or detok.stopped or len(held.token_ids) >= self.stream_interval:
                    yield _release(held, usage)
                if detok.stopped:
                    finish = PB.FINISH_REASON_STOP
                    break
                if ev.finish:
                    finish = ev.finish
                    break
        except NoWorkerAvailable as exc:
            self.metrics.rejected("unavailable")
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except Overloaded as exc:
            self.metrics.rejected("overloaded")
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if state.shutting_down:
                self.metrics.finished(PB.FINISH_REASON_ERROR, t0, None)
                if held.token_ids:
                    yield _release(held, usage)
                yield PB.GenerateResponse(error=PB.Error(code="UNAVAILABLE", message=SHUTDOWN_MESSAGE, usage=usage))
                return
            if not state.aborted:
                if isinstance(exc, asyncio.CancelledError):
                    self.metrics.finished(PB.FINISH_REASON_ABORT, t0, None)
                    raise
                log.warning("request %s: %s worker failed: %s", req.request_id, exc.code().name, exc.details())
                message = f"worker failed: {redact_addresses(exc.details() or '')}"
                self.metrics.finished(PB.FINISH_REASON_ERROR, t0, None)
                if last_ns is None:
                    raise RequestRejected(exc.code(), message) from None
                if held.token_ids:
                    yield _release(held, usage)
                yield PB.GenerateResponse(error=PB.Error(code=exc.code().name, message=message, usage=usage))
                return
            finish = PB.FINISH_REASON_ABORT
        except GeneratorExit:  # the consumer closed the stream (an HTTP client went away)
            self.metrics.finished(PB.FINISH_REASON_ABORT, t0, None)
            raise
        finally:
            await events.aclose()
            self.inflight.pop(req.request_id, None)
            if state.stalled:  # ended while stalled: it leaves the gauge now too
                state.stalled = False
                self.metrics.stalled.dec()
        rest = "" if detok.stopped or finish == PB.FINISH_REASON_ABORT else detok.finish()
        if timings_ns is not None and last_ns is not None:  # ended before the worker's last message
            timings.decode_ns += last_ns - timings_ns
        timings.total_ns = time.monotonic_ns() - t0
        self.metrics.finished(finish, t0, timings, usage.prompt_tokens)
        if self.rebalancer is not None and first_ns is not None and finish != PB.FINISH_REASON_ABORT:
            n = usage.completion_tokens
            self.rebalancer.observe_request(first_ns - t0, (last_ns - first_ns) / (n - 1) if n > 1 else None)
        if held.token_ids:  # an abort's last tokens
            yield _release(held, usage)
        yield PB.GenerateResponse(
            complete=PB.Complete(
                finish_reason=finish, usage=usage, text=rest, timings=timings, request_id=req.request_id
            )
        )

    def shut_down(self) -> None:
        """Refuse new requests (UNAVAILABLE) and end every stream in flight with an in-band
        UNAVAILABLE "server shutting down" error (their worker calls are cancelled)."""
        self.shutting_down = True
        for state in list(self.inflight.values()):
            state.shut_down()

    def abort(self, request_id: str, owner: int | None = None) -> bool:
        """Cancel a request in flight that ``owner`` (an API key index) sent; False when no such
        request of that owner is running."""
        state = self.inflight.get(request_id)
        if state is None or state.owner != owner:
            return False
        state.abort()
        return True


def _release(held: PB.Chunk, usage: PB.Usage) -> PB.GenerateResponse:
    """The held tokens and text as one chunk with the usage so far; ``held`` is emptied."""
    msg = PB.GenerateResponse(chunk=PB.Chunk(token_ids=held.token_ids, text=held.text, usage=usage))
    held.Clear()
    return msg
