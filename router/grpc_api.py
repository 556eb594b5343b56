"""The router's front ends: the gRPC GenerateService and, optionally, the OpenAI-compatible HTTP
server, both over one Frontend on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from pdserve.router.frontend import Frontend, RequestRejected
from pdserve.router.local_prefill import LocalPrefill
from pdserve.router.pool import WorkerPool
from pdserve.router.role_balancer import RoleBalancer
from pdserve.rpc.auth import carries_cluster_secret, cluster_secret, require_api_key
from pdserve.rpc.server import start_server
from pdserve.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger(__name__)
PB = generate_pb2
GENERATE_SERVICE = "pdserve.v1.GenerateService"


class RouterServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Implements pdserve.v1.GenerateService over a Frontend.

    Errors: INVALID_ARGUMENT for a bad request, ALREADY_EXISTS for a request id already in flight,
    UNAVAILABLE when no worker of a needed role is healthy, and the worker's status code when a
    worker call fails before anything was streamed; after that, the failure is sent as the stream's
    last message (``Error``).
    """

    def __init__(self, core: Frontend) -> None:
        self.core = core

    async def Generate(self, request: PB.GenerateRequest, context: grpc.aio.ServicerContext):
        stream = self.core.generate(
            request, context.time_remaining(), self.core.owner_of(context.invocation_metadata())
        )
        try:
            async for message in stream:
                yield message
        except RequestRejected as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's retry hint (A6 retry pushback)
                context.set_trailing_metadata((("grpc-retry-pushback-ms", "1000"),))
            await context.abort(exc.code, exc.message)
        finally:
            await stream.aclose()

    async def Abort(self, request: PB.AbortRequest, context) -> PB.AbortResponse:
        return PB.AbortResponse(
            aborted=self.core.abort(request.request_id, self.core.owner_of(context.invocation_metadata()))
        )

    async def GetModelInfo(self, request, context) -> PB.ModelInfo:
        """The admin view (model folder, worker addresses) only for a call carrying the cluster
        secret; a router without one shows it to nobody."""
        admin = carries_cluster_secret(context.invocation_metadata(), cluster_secret())
        return self.core.model_info(admin)


def _readiness(pool: WorkerPool, health_servicer):
    """After each stats poll: the router's health (``""`` and GenerateService) is SERVING only
    while every pool it needs has a healthy worker; each change is logged."""
    state = {"status": None}

    async def update() -> None:
        missing = pool.roles_without_healthy_worker()
        status = health_pb2.HealthCheckResponse.NOT_SERVING if missing else health_pb2.HealthCheckResponse.SERVING
        if status == state["status"]:
            return
        if missing:
            log.warning("router not ready: no healthy %s worker", " or ".join(missing))
        elif state["status"] is not None:
            log.info("router ready again: every pool has a healthy worker")
        state["status"] = status
        for name in ("", GENERATE_SERVICE):
            await health_servicer.set(name, status)

    return update


@dataclass
class RunningRouter:
    """A serving router: ``address`` is the gRPC "host:port", ``http_address`` the HTTP one (None: off)."""

    core: Frontend
    server: grpc.aio.Server
    address: str
    http: object | None = None  # uvicorn.Server
    http_task: asyncio.Task | None = None
    http_address: str | None = None

    async def stop(self, grace_s: float = 1.0) -> None:
        """Graceful: new requests are refused and streams in flight end with an in-band UNAVAILABLE
        "server shutting down" error; then both servers stop (``grace_s`` for the last messages)."""
        self.core.shut_down()
        await asyncio.sleep(0.05)  # let the streams send their error messages
        if self.http is not None:
            self.http.should_exit = True
            await asyncio.wait([self.http_task], timeout=grace_s + 2.0)
        await self.server.stop(grace_s)
        if self.core.rebalancer is not None:
            await self.core.rebalancer.stop()
        await self.core.pool.close()


async def start_http(core: Frontend, host: str, port: int, tls: tuple[str, str] | None = None):
    """uvicorn serving the OpenAI API on this event loop; (server, task, bound port).

    OSError when the port cannot be bound."""
    import uvicorn

    from pdserve.router.openai_api import build_app

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the process that hosts the router owns SIGINT/SIGTERM
            yield

    ssl = dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}
    config = uvicorn.Config(
        build_app(core), host=host, port=port, log_level="warning", lifespan="off", access_log=False, **ssl
    )
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # failed to bind: uvicorn logs the reason and exits
            raise OSError(f"the HTTP server could not listen on {host}:{port}")
        await asyncio.sleep(0.01)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def serve(
    model_dir: Path,
    prefill: list[str] = (),
    decode: list[str] = (),
    colocated: list[str] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    max_model_len: int | None = None,
    http_port: int | None = None,
    model_name: str | None = None,
    api_keys: tuple[str, ...] = (),
    max_requests_per_worker: int = 0,
    stream_interval: int = 1,
    tls: tuple[str, str] | None = None,
    routing: str = "prefix-aware",
    local_prefill_tokens: int = 0,
    local_prefill_policy: str = "prefix",
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> RunningRouter:
    """Start the router for a split (``prefill`` + ``decode``) or colocated (``colocated``) pool.

    ``http_port``: also serve the OpenAI-compatible API there (0: any free port; None: no HTTP).
    ``model_name``: the model id clients see and send (default: the model folder's name); give a
    name, not a path (GetModelInfo and /v1/models show it to every client).
    ``api_keys``: when given, both APIs want ``authorization: Bearer <one of them>`` (else
    UNAUTHENTICATED / HTTP 401, counted in ``pdserve:requests_rejected_total``); health,
    reflection and /metrics stay open.
    ``max_requests_per_worker``: past it on every decode (colocated) worker, RESOURCE_EXHAUSTED
    (HTTP 429 with Retry-After); 0: no bound. ``stream_interval``: tokens per streamed message to a
    client (``Frontend``). ``tls``: (certificate chain file, private key file,
    both PEM) to serve both client-facing APIs over TLS (gRPC over TLS, HTTPS); internal calls stay
    on the cluster's own channels. OSError when a file cannot be read.
    ``routing``: ``prefix-aware`` or ``least-loaded`` (``WorkerPool``); ``local_prefill_tokens``
    and ``local_prefill_policy``: the local-prefill rule (``LocalPrefill``); ``slo_ttft_ms`` and
    ``slo_tpot_ms``: the latency targets of an auto placement's role switching (``RoleBalancer``).
    Switchable workers (``pdserve.switchable_worker``), given as ``prefill`` and ``decode`` in
    their first roles (``prefill`` may be empty), make an auto placement whose roles change at run
    time. ValueError when the pool is neither split, colocated nor auto, or the local-prefill rule
    is invalid; OSError when a port cannot be bound.
    """
    local_prefill = LocalPrefill(local_prefill_tokens, local_prefill_policy)
    if colocated and (prefill or decode):
        raise ValueError("give either prefill + decode workers (split) or colocated workers, not both")
    if not colocated and not decode:
        raise ValueError("split placement needs at least one prefill and one decode worker")
    pool = WorkerPool(list(prefill), list(decode), list(colocated), max_requests_per_worker, routing)
    try:
        await pool.start()
        if not colocated and not prefill and pool.placement != "auto":
            raise ValueError("split placement needs at least one prefill and one decode worker")
    except BaseException:
        await pool.close()
        raise
    core = Frontend(
        model_dir,
        pool,
        max_model_len,
        api_keys=tuple(api_keys),
        model_name=model_name,
        local_prefill=local_prefill,
        stream_interval=stream_interval,
        role_balancer=RoleBalancer(
            slo_ttft_s=slo_ttft_ms / 1e3 if slo_ttft_ms else None, slo_tpot_s=slo_tpot_ms / 1e3 if slo_tpot_ms else None
        ),
    )
    health_servicer = health.aio.HealthServicer()
    interceptors = (
        [require_api_key(core.api_keys, lambda: core.metrics.rejected("unauthenticated"))] if core.api_keys else None
    )
    server, bound = await start_server(
        [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, RouterServicer(core), GENERATE_SERVICE)],
        host,
        port,
        health_servicer,
        interceptors=interceptors,
        tls=(Path(tls[0]).read_bytes(), Path(tls[1]).read_bytes()) if tls else None,
    )
    pool.on_refresh.append(_readiness(pool, health_servicer))
    await pool.on_refresh[-1]()
    pool.on_refresh.append(core.watch_stalls)
    if core.rebalancer is not None:
        pool.on_refresh.append(core.rebalancer.on_refresh)
    running = RunningRouter(core, server, f"{host}:{bound}")
    if http_port is not None:
        try:
            running.http, running.http_task, http_bound = await start_http(core, host, http_port, tls)
        except BaseException:
            await running.stop()
            raise
        running.http_address = f"{host}:{http_bound}"
    return running
