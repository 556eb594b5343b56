"""gRPC plumbing shared by every server: channel options, start-up with health checking, reflection
and the refusal of request bytes that do not parse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.rpc import reflection_v1
from pdserve.rpc.request_bytes import RefuseUndecodable

# Large enough for KV chunks and long prompts; KV chunks stay <= 1 MiB by default anyway.
MAX_MESSAGE_BYTES = 64 << 20
# Keepalive, on every server and channel: an open call notices a dead connection within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (30 s) and fails UNAVAILABLE. Without it, during a link
# cut longer than 20 s a server silently drops a connection whose sent data stays unacknowledged
# that long (gRPC's TCP_USER_TIMEOUT), and the caller, with nothing to send, waits on it until its
# deadline, or for ever (tests/integration/test_two_nodes.py). gRPC also makes KEEPALIVE_TIMEOUT_MS
# the caller's TCP_USER_TIMEOUT. Pings go on while a call waits without data (a decode stream
# waiting for its KV), and servers accept them every 5 s.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 20_000
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # no limit
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # a server's floor for its clients' pings
    ("grpc.max_reconnect_backoff_ms", 5_000),  # reconnect within 5 s of a link coming back
]
# A call the server has not yet handed to its handlers waits this long before gRPC cancels it (the
# default is 30 s). Under a flood of arrivals a router's event loop takes calls later than they
# come; with the default, the calls left waiting 30 s ended CANCELLED instead of being refused or
# served (the overload soak, ``pdserve soak --overload-s 60``: 126 to 1,777 of ~5,700 requests),
# and the cancels cost more work still. A caller's own deadline still ends its call as ever.
MAX_UNREQUESTED_S = 3600
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.server_max_unrequested_time_in_server", MAX_UNREQUESTED_S),
    # gRPC binds with SO_REUSEPORT by default, so a second server on a port already served would
    # start and silently share its connections; without it the bind fails and start_server says so.
    ("grpc.so_reuseport", 0),
]


async def start_server(
    register: list[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    host: str = "127.0.0.1",
    port: int = 0,
    health_servicer: health.aio.HealthServicer | None = None,
    interceptors: list | None = None,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a ``grpc.aio`` server with the given servicers plus health checking and reflection
    (v1 and v1alpha), which list exactly the services this server serves. A request whose bytes do
    not parse as its method's message ends with INVALID_ARGUMENT (``rpc/request_bytes.py``).

    register: (add_XServicer_to_server, servicer, full service name) triples. Every service is
    reported SERVING; pass ``health_servicer`` to change that later (the router reports
    NOT_SERVING while a pool has no healthy worker). ``interceptors``: server interceptors, such as
    ``auth.require_api_key`` (health and reflection stay open). ``tls``: (PEM certificate chain,
    PEM private key) to serve TLS instead of plaintext. Returns the server and the bound port
    (``port=0`` picks a free one). Raises RuntimeError when the port cannot be bound.
    """
    interceptors = [*(interceptors or ()), RefuseUndecodable()]
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    names = [reflection_v1.SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME]
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    reflection_v1.enable(names, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(tls[1], tls[0])]))
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
