"""Who may call a pdserve server: client API keys on the router, a cluster secret between the
router and its workers.

- **API keys** (``--api-key`` / ``$PDSERVE_API_KEY``, comma-separated for several): the router's
  client-facing gRPC API wants ``authorization: Bearer <key>`` metadata (the HTTP API the same
  header). A wrong or missing key is UNAUTHENTICATED.
- **The cluster secret** (``$PDSERVE_CLUSTER_SECRET``; a cluster makes one and hands it to its
  actors): every internal call (prefill, decode, colocated, worker stats, KV push) carries it as
  ``x-pdserve-cluster-secret`` metadata, and a worker refuses calls without it, so a stranger on
  the network can neither push KV nor read stats. On the router it also opens the admin view of
  ``GetModelInfo`` (the model folder and the worker addresses, which other callers never see).

Health checking and reflection stay open (load balancers and grpcurl use them). Keys are compared
in constant time and never logged.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)
SECRET_ENV, SECRET_HEADER = "PDSERVE_CLUSTER_SECRET", "x-pdserve-cluster-secret"
API_KEY_ENV = "PDSERVE_API_KEY"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def cluster_secret() -> str | None:
    """This process's cluster secret, or None (internal calls are then open: a test or a lone worker)."""
    return os.environ.get(SECRET_ENV) or None


def parse_api_keys(value: str | None) -> tuple[str, ...]:
    """``--api-key`` / ``$PDSERVE_API_KEY``: comma-separated keys, blanks dropped; () for None.

    ValueError when a value is given but holds no key (``""``, ``","``: authentication would be
    silently off), or a key is not printable ASCII (gRPC metadata and HTTP headers cannot carry it).
    """
    if value is None:
        return ()
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys:
        raise ValueError("--api-key / $PDSERVE_API_KEY is set but holds no key; give a key or leave it unset")
    if any(not (k.isascii() and k.isprintable()) for k in keys):
        raise ValueError("API keys must be printable ASCII (they travel in gRPC metadata and HTTP headers)")
    return keys


def key_index(keys: tuple[str, ...], presented: str | None) -> int | None:
    """Which of ``keys`` was presented (constant-time compare), else None."""
    if presented is None:
        return None
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(key.encode(), presented.encode()):
            found = i
    return found


def bearer(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, else None."""
    for k, v in metadata or ():
        if k.lower() == "authorization" and isinstance(v, str) and v[:7].lower() == "bearer ":
            return v[7:].strip()
    return None


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # makes this an async generator; never reached

    ser = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
    return grpc.stream_stream_rpc_method_handler(streaming, **ser)


class CheckMetadata(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call but health and reflection whose metadata ``allowed``
    rejects; ``what`` names the credential in the error and the log, ``on_refused()`` runs once
    per refused call (e.g. to count it)."""

    def __init__(
        self, allowed: Callable[[tuple], bool], what: str, on_refused: Callable[[], None] | None = None
    ) -> None:
        self.allowed, self.what = allowed, what
        self.on_refused = on_refused or (lambda: None)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES) or self.allowed(details.invocation_metadata):
            return handler
        log.warning("refused %s: missing or wrong %s", details.method, self.what)
        self.on_refused()
        return _denied(handler, f"missing or wrong {self.what}")


def require_api_key(keys: tuple[str, ...], on_refused: Callable[[], None] | None = None) -> CheckMetadata:
    return CheckMetadata(
        lambda md: key_index(keys, bearer(md)) is not None, "API key (authorization: Bearer)", on_refused
    )


def carries_cluster_secret(metadata, secret: str | None) -> bool:
    """Whether ``metadata`` (key, value pairs) carries ``secret`` as ``x-pdserve-cluster-secret``
    (constant-time compare); always False when there is no secret."""
    value = next((v for k, v in metadata or () if k == SECRET_HEADER), None)
    return bool(secret) and isinstance(value, str) and hmac.compare_digest(value.encode(), secret.encode())


def require_cluster_secret(secret: str) -> CheckMetadata:
    return CheckMetadata(lambda md: carries_cluster_secret(md, secret), "cluster secret")


class _AddMetadata:
    """Adds ``(key, value)`` to every call's metadata."""

    def __init__(self, key: str, value: str) -> None:
        self.entry = (key, value)

    def _details(self, d):
        metadata = list(d.metadata or ()) + [self.entry]
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, grpc.aio.Metadata(*metadata), d.credentials, d.wait_for_ready
        )


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def _adding(key: str, value: str) -> list:
    """One interceptor per call kind: a grpc.aio channel files each interceptor under one kind only."""
    return [kind(key, value) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def client_channel(address: str, options, api_key: str | None = None, tls_ca: bytes | None = None) -> grpc.aio.Channel:
    """A channel to a router that sends ``authorization: Bearer <api_key>`` on every call (when
    given); over TLS, trusting the PEM ``tls_ca``, when that is given."""
    interceptors = _adding("authorization", f"Bearer {api_key}") if api_key else None
    if tls_ca is not None:
        return grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(tls_ca), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def internal_channel(address: str, options) -> grpc.aio.Channel:
    """A channel to another pdserve server of this cluster, carrying the cluster secret if any."""
    secret = cluster_secret()
    interceptors = _adding(SECRET_HEADER, secret) if secret else None
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
