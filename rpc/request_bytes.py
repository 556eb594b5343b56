"""Requests whose bytes do not parse as the method's request message: refused with INVALID_ARGUMENT.

Left to grpc.aio, a request deserializer that raises ends the call with UNKNOWN ("Unexpected
<class 'DecodeError'>") and logs a traceback at ERROR level. ``RefuseUndecodable``, a server
interceptor that ``start_server`` installs on every server, wraps each method's deserializer so
that the call instead ends with INVALID_ARGUMENT, "request is not a valid pdserve.v1.X (N bytes):
<what the parser found>", logged as one WARNING line, and the server goes on serving.

- **Unary requests** (``unary_unary``, ``unary_stream``): the wrapped deserializer hands the
  handler an ``Undecodable`` in place of the request; the wrapped handler aborts before the
  servicer runs.
- **Streamed requests** (``stream_unary``, ``stream_stream``): reading a bad message raises
  ``UndecodableRequest`` (a ValueError) inside the servicer's loop over its requests, so a servicer
  that cleans up after a failed stream (a KV push) still does; raised out of the servicer, it
  becomes INVALID_ARGUMENT.

Handlers that are neither coroutine nor async generator functions are left as they are: grpc.aio
runs those in a thread pool, and in pdserve they are only the generated servicers' defaults for a
method a servicer does not implement (UNIMPLEMENTED).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class UndecodableRequest(ValueError):
    """A request message whose bytes do not parse; the message says which type was expected and why."""


class Undecodable:
    """Stands in for a unary request that did not parse; ``message`` says why."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _type_name(deserializer) -> str:
    """The full protobuf name of the message ``deserializer`` (a ``Message.FromString``) parses."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request message"


def describe(deserializer, raw: bytes, exc: Exception) -> str:
    """What a person needs to know about request bytes ``raw`` that ``deserializer`` refused with ``exc``."""
    name = _type_name(deserializer)
    reason = str(exc) or type(exc).__name__
    prefix = f"Error parsing message with type '{name}': "  # protobuf's wording, which repeats the name
    if reason.startswith(prefix):
        reason = reason[len(prefix) :]
    return f"request is not a valid {name} ({len(raw)} bytes): {reason}"


def _deserializer(deserializer, method: str, streamed: bool):
    """``deserializer`` that, for bytes it refuses, logs one WARNING and returns an ``Undecodable``
    (a unary request) or raises ``UndecodableRequest`` (a streamed one)."""

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:
            message = describe(deserializer, raw, exc)
            log.warning("refused %s: %s", method, message)
            if streamed:
                raise UndecodableRequest(message) from None
            return Undecodable(message)

    return deserialize


def _unary_request(behavior):
    """``behavior`` (unary request) preceded by the check for an ``Undecodable`` request."""
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return streaming

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary


def _stream_request(behavior):
    """``behavior`` (streamed requests) with an ``UndecodableRequest`` it lets out turned into INVALID_ARGUMENT."""
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request_iterator, context):
            try:
                async with contextlib.aclosing(behavior(request_iterator, context)) as responses:
                    async for response in responses:
                        yield response
            except UndecodableRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        return streaming

    async def unary(request_iterator, context):
        try:
            return await behavior(request_iterator, context)
        except UndecodableRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    return unary


def _is_async(behavior) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def refusing_undecodable(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with its deserializer and behavior wrapped as the module says (unchanged when it
    has no deserializer or a handler grpc.aio runs in a thread)."""
    kind = "unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream else None
    kind = kind or ("stream_unary" if handler.stream_unary else "stream_stream")
    behavior = getattr(handler, kind)
    if handler.request_deserializer is None or behavior is None or not _is_async(behavior):
        return handler
    if kind.startswith("unary_"):
        deserializer = _deserializer(handler.request_deserializer, method, streamed=False)
        wrapped = _unary_request(behavior)
    else:
        deserializer = _deserializer(handler.request_deserializer, method, streamed=True)
        wrapped = _stream_request(behavior)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(wrapped, request_deserializer=deserializer, response_serializer=handler.response_serializer)


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Server interceptor: every method's undecodable requests end with INVALID_ARGUMENT (see the module).

    Each method's handler is wrapped once and reused. Installed after any other interceptor, so
    that, for instance, a caller without an API key is refused UNAUTHENTICATED whatever it sent."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        known = self._wrapped.get(details.method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = refusing_undecodable(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped
