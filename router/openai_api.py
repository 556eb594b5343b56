"""The router's OpenAI-compatible HTTP server (FastAPI on uvicorn, on the router's event loop).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
ending in ``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``GET /health`` (200 only when
every pool has a healthy worker, else 503) and ``GET /metrics`` (Prometheus text format). With API
keys (``core.api_keys``), every route but ``/health`` wants ``authorization: Bearer KEY``: 401 with
``www-authenticate: Bearer`` otherwise, counted as an ``unauthenticated`` rejection.

Errors are OpenAI error objects, whose ``param`` names the field at fault as the client sent it
(``max_completion_tokens``, ``messages``): 400 for a bad request (malformed JSON, wrong types, ``n``
other than 1, over the context window, bad sampling values, chat on a model without a template), 404 for
an unknown model, 503 when no worker can serve, 504 when a worker's deadline passed, 500 otherwise.
A failure after tokens were streamed arrives as a ``data: {"error": ...}`` event before ``[DONE]``.
A client that disconnects cancels its request on every worker, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.router.chat import ChatTemplate, ChatTemplateError
from pdserve.router.frontend import Frontend, RequestRejected
from pdserve.router.openai_protocol import BadRequest, ChatRequest, CompletionRequest, parse
from pdserve.router.openai_responses import ResponseShape, error_body, timings_json
from pdserve.router.prometheus import CONTENT_TYPE
from pdserve.router.validation import InvalidRequest, check_text_fits

log = logging.getLogger(__name__)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
DISCONNECT_POLL_S = 0.2
MAX_BODY_BYTES = 64 << 20  # as the gRPC API's largest message


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def build_app(core: Frontend) -> FastAPI:
    """The FastAPI app over ``core``; ``core.model_name`` is the id clients see and send as ``model``
    (the folder's path and name are accepted too, but never shown)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    chat_template = ChatTemplate.from_folder(core.model_dir)
    model_name = core.model_name
    names = {model_name, str(core.model_dir), core.model_dir.name}

    async def read(request: Request, kind):
        try:
            body = await request.body()
        except ClientDisconnect as exc:  # answered for the record; nobody is left to read it
            raise BadRequest("the client closed the connection before the whole request body arrived") from exc
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(f"the request body has {len(body)} bytes; at most {MAX_BODY_BYTES} are accepted")
        req = await asyncio.to_thread(parse, kind, body)
        if req.model is not None and req.model not in names:
            raise LookupError(f"The model `{req.model}` does not exist; this server serves `{model_name}`.")
        return req

    def unauthorized(request: Request) -> JSONResponse | None:
        if core.api_keys and core.owner_of(request.headers.items()) is None:
            core.metrics.rejected("unauthenticated")
            log.warning("refused %s %s: missing or wrong API key", request.method, request.url.path)
            return JSONResponse(
                error_body("missing or wrong API key (authorization: Bearer)", 401),
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )  # RFC 6750
        return None

    async def handle(request: Request, kind: str):
        if (refused := unauthorized(request)) is not None:
            return refused
        try:
            if kind == "completion":
                req = await read(request, CompletionRequest)
                gen_req = req.to_generate_request()
            else:
                req = await read(request, ChatRequest)
                text = chat_template.render(
                    [m.for_template() for m in req.messages], req.add_generation_prompt is not False
                )
                check_text_fits(text, core.tokenizer, core.max_model_len)
                ids = await asyncio.to_thread(core.tokenizer.encode, text, False)
                gen_req = req.to_generate_request(ids)
        except BadRequest as exc:
            core.metrics.rejected("invalid")
            return _error(str(exc), 400, exc.param)
        except (ChatTemplateError, InvalidRequest) as exc:  # no template, or the rendered prompt cannot fit
            core.metrics.rejected("invalid")
            return _error(str(exc), 400, "messages")
        except LookupError as exc:
            core.metrics.rejected("invalid")
            return _error(str(exc), 404, "model")
        gen_req.request_id = uuid.uuid4().hex
        stream = core.generate(gen_req, None, core.owner_of(request.headers.items()), req.field_names())
        try:
            first = await _unless_gone(request, anext(stream))
        except ClientGone:
            log.info("client went away before its first token; request %s cancelled", gen_req.request_id)
            await stream.aclose()
            return Response(status_code=499)
        except RequestRejected as exc:
            await stream.aclose()
            response = _error(exc.message, HTTP_STATUS.get(exc.code, 500), exc.param)
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                response.headers["retry-after"] = "1"
            return response
        shape = ResponseShape(kind, gen_req.request_id, model_name)
        if req.streaming:
            return StreamingResponse(_stream(stream, first, shape, req.include_usage), media_type="text/event-stream")
        return await _collect(request, stream, first, shape)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    card = {
        "id": model_name,
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "root": model_name,
        "max_model_len": core.max_model_len,
    }  # root: vLLM's field; the id here, never a path

    @app.get("/v1/models")
    async def models(request: Request):
        return unauthorized(request) or {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        if (refused := unauthorized(request)) is not None:
            return refused
        if model_id not in names:
            return _error(f"The model `{model_id}` does not exist; this server serves `{model_name}`.", 404, "model")
        return card

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown routes, wrong methods
        return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    # one operation per method would share an OpenAPI operation id; a probe is no API operation anyway
    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health():
        missing = core.pool.roles_without_healthy_worker()
        if missing:
            return _error(f"no healthy {' or '.join(missing)} worker", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request):  # Prometheus sends the key as its scrape's bearer token
        return unauthorized(request) or Response(core.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


async def _stream(stream: AsyncIterator, first, shape: ResponseShape, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE events of one request; cancelling this (a client gone) cancels the request."""
    opened = False
    try:
        message = first
        while True:
            which = message.WhichOneof("kind")
            if which == "chunk":  # no event for a chunk without text (a character's bytes held back)
                event = shape.delta(message.chunk.text, first=not opened)
                if event is not None:
                    yield _sse(event)
                    opened = True
            elif which == "complete":
                c = message.complete
                final = shape.delta(c.text, c.finish_reason)
                final["pdserve"] = timings_json(c.timings)
                yield _sse(final)
                if include_usage:
                    yield _sse(shape.usage_chunk(c.usage))
                break
            else:  # error after tokens were streamed
                e = message.error
                yield _sse(error_body(f"{e.code}: {e.message}", 503 if e.code == "UNAVAILABLE" else 500))
                break
            message = await anext(stream)
        yield b"data: [DONE]\n\n"
    finally:
        await stream.aclose()


class ClientGone(Exception):
    """The HTTP client disconnected while its request waited."""


async def _unless_gone(request: Request, awaitable):
    """``awaitable``'s result, polling every DISCONNECT_POLL_S for the client's disconnect; then
    it is cancelled (a request still queued or prefilling is cancelled on every worker) and
    ClientGone is raised."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ClientGone()
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _collect(request: Request, stream: AsyncIterator, first, shape: ResponseShape):
    """One JSON body; a client that disconnects before the end cancels the request."""

    async def run():
        parts, message = [], first
        while True:
            which = message.WhichOneof("kind")
            if which == "chunk":
                parts.append(message.chunk.text)
            elif which == "complete":
                c = message.complete
                parts.append(c.text)
                return JSONResponse(shape.full("".join(parts), c.finish_reason, c.usage, c.timings))
            else:
                e = message.error
                return _error(f"{e.code}: {e.message}", 503 if e.code == "UNAVAILABLE" else 500)
            message = await anext(stream)

    try:
        return await _unless_gone(request, run())
    except ClientGone:
        log.info("client went away; request %s cancelled", shape.id)
    finally:
        await stream.aclose()
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
