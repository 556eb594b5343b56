"""Start and stop a pdserve cluster (router + workers) on a local or existing Ray instance."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field, replace

import psutil
import ray

from pdserve.cluster.actors import RouterActor, WorkerActor
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.supervisor import Supervised, Supervisor
from pdserve.rpc.auth import cluster_secret

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
WORKER_MAX_RESTARTS = 10  # per worker, over the cluster's life
RAY_START_ATTEMPTS = 3  # a local ray.init that times out is cleaned up and tried again
RAY_CONNECT_TIMEOUT_S = 5.0  # --address: how long a TCP connection to the Ray head may take
LOOPBACK = "127.0.0.1"  # the IP of a local Ray node: every server of its session listens there only


@dataclass
class Cluster:
    """A running cluster. ``address`` is the router's gRPC "host:port", ``http_address`` its
    OpenAI-compatible HTTP one (None when off); ``workers`` maps address -> role."""

    config: ClusterConfig
    address: str = ""
    http_address: str | None = None
    secret: str = field(default="", repr=False)  # what internal calls carry (an admin may use it too)
    workers: dict[str, str] = field(default_factory=dict)
    supervisor: Supervisor | None = field(default=None, repr=False)
    _actors: list = field(default_factory=list, repr=False)
    _started_ray: bool = False

    def stop(self) -> None:
        """Stop the supervisor, the router, then the workers; shut Ray down if this cluster started it."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        for actor in reversed(self._actors):  # router first: it was started last
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception as exc:  # a dead actor must not keep the others alive
                log.warning("stopping actor failed: %s", exc)
            ray.kill(actor)
        self._actors.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _init_ray(cfg: ClusterConfig, needed_cpus: int) -> bool:
    """Connect to Ray; returns True when a local instance was started here."""
    if ray.is_initialized():
        return False
    if cfg.ray_address:
        check_ray_address(cfg.ray_address)
        ray.init(address=cfg.ray_address, configure_logging=False, log_to_driver=True)
        return False
    cpus = os.cpu_count() or 1
    if needed_cpus > cpus:
        log.warning("placement asks for %d CPUs, this machine has %d: workers will share cores", needed_cpus, cpus)
    _start_local_ray(max(cpus, needed_cpus))
    return True


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Fail fast when nothing listens at a Ray cluster's address ("host:port", or "ray://host:port"
    for Ray Client; "auto" is left to Ray). ``ray.init`` on a dead address retries for minutes and
    does not stop on Ctrl-C, and one that accepts connections but is no Ray head waits for ever.
    Raises ValueError for an address without a port, RuntimeError when no TCP connection opens
    within ``timeout_s`` seconds or no gRPC handshake (a GCS, or Ray Client's server, speaks gRPC)
    completes within it; the handshake is not tried where Ray runs TLS (``$RAY_USE_TLS``)."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--address {address!r}: expected host:port (a Ray head's GCS, e.g. 10.0.0.5:6379), ray://host:port or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RuntimeError(
            f"cannot reach a Ray cluster at {address}: {reason}; start one there "
            f"(`ray start --head`) or leave out --address to start a local one"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return
    import grpc

    channel = grpc.insecure_channel(hostport)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise RuntimeError(
            f"{address} accepts connections but does not answer as a Ray cluster (no gRPC handshake within "
            f"{timeout_s:g} s): give the Ray head's GCS address (`ray start --head` prints it)"
        ) from None
    finally:
        channel.close()


def _start_local_ray(num_cpus: int) -> None:
    """``ray.init`` of a local instance, tried up to RAY_START_ATTEMPTS times.

    Ray gives a new raylet a fixed 30 s to register with its GCS and raises a plain Exception
    ("The current node timed out during startup") past that; on a loaded machine this can happen
    once and not again. A failed start leaves its GCS and raylet running (Ray forgets a node whose
    start failed), so the processes it spawned are killed before the next try. Raises the last
    attempt's exception; ValueError and TypeError (bad arguments) are not retried, and a
    KeyboardInterrupt (Ctrl-C while Ray starts) kills what it spawned and propagates.
    The node listens on loopback only (``_loopback_node``).
    """
    me = psutil.Process()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            with _loopback_node():
                ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=True)
            if ray.is_initialized() and (ip := ray.util.get_node_ip_address()) != LOOPBACK:
                log.warning(
                    "the local Ray node took the IP %s, not %s: its processes listen on every interface", ip, LOOPBACK
                )
            return
        except (ValueError, TypeError):
            raise
        except BaseException as exc:  # Ctrl-C too: the raylet's agents would outlive this process
            ray.shutdown()
            spawned = [p for p in me.children(recursive=True) if p.pid not in before]
            for proc in spawned:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(spawned, timeout=10)
            if attempt == RAY_START_ATTEMPTS or not isinstance(exc, Exception):
                raise
            log.warning(
                "local Ray failed to start (%s); killed %d of its processes, trying again (%d of %d)",
                exc,
                len(spawned),
                attempt + 1,
                RAY_START_ATTEMPTS,
            )


@contextlib.contextmanager
def _loopback_node():
    """A local Ray node started inside this block takes the IP ``LOOPBACK``.

    Ray binds its servers by the node's IP: the GCS, the raylet's node and object managers, every
    core worker (driver and actors), the dashboard agent's gRPC and metrics-export servers and the
    autoscaler monitor's metrics server listen on loopback when it is 127.0.0.1 and on every
    interface otherwise; the runtime-env agent and the dashboard agent's HTTP server bind the node's
    IP. On Linux ``ray.init`` gives a new node the machine's outward address, and turns
    ``_node_ip_address="127.0.0.1"`` into it too, unless Ray's ``ENABLE_RAY_CLUSTER`` is off (its
    setting on macOS and Windows, ``$RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``): then the node is
    127.0.0.1. Ray reads the setting when it picks the IP, so it is off only for this block, in
    this process (Ray's processes get the IP on their command lines).
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # another Ray: _start_local_ray warns
        yield
        return
    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def start_cluster(cfg: ClusterConfig) -> Cluster:
    """Start workers (in parallel), then the router; returns once the router serves.

    Split placement gives each worker one GPU when the Ray cluster has GPUs, else ``cpus_per_worker``
    CPUs. Worker addresses are discovered from the actors. Raises RuntimeError (after stopping what
    started) when a worker or the router fails to start.
    """
    model_dir = _resolve_model(cfg)
    model_name = cfg.served_model_name  # from the spec the user gave, before it is resolved
    cfg = replace(cfg, engine=replace(cfg.engine, model=str(model_dir)))
    roles = cfg.roles
    started = _init_ray(cfg, len(roles) * cfg.cpus_per_worker)
    cluster = Cluster(cfg, _started_ray=started)
    bind = "127.0.0.1" if started else "0.0.0.0"
    t0 = time.monotonic()
    try:
        use_gpu = cfg.use_gpus(ray.cluster_resources().get("GPU", 0))
        engine_cfg = cfg.worker_engine(use_gpu)
        opts = {"num_gpus": 1, "num_cpus": 1} if use_gpu else {"num_cpus": cfg.cpus_per_worker}
        # Ray restarts a dead worker process; the supervisor then starts its server again
        actors = [
            WorkerActor.options(
                max_restarts=WORKER_MAX_RESTARTS, max_task_retries=0, **opts, resources=cfg.role_resources(r)
            ).remote()
            for r in roles
        ]
        cluster._actors.extend(actors)
        # pin CPU workers to their own cores on a local machine (a remote cluster's nodes are its own)
        pin = started and not use_gpu and sys.platform.startswith("linux")
        cpu_sets = cfg.cpu_sets(os.cpu_count() or 1) if pin else None
        # internal calls carry it, and it opens the router's admin view; strangers do not have it
        secret = cluster.secret = cluster_secret() or secrets.token_hex(32)
        switchable = cfg.placement == "auto"
        start_args = [
            (r, engine_cfg, bind, cpu_sets[i] if cpu_sets else None, secret, switchable) for i, r in enumerate(roles)
        ]
        addresses = ray.get([a.start.remote(*args) for a, args in zip(actors, start_args)], timeout=START_TIMEOUT_S)
        cluster.workers = dict(zip(addresses, roles))
        by_role = {r: [a for a, rr in zip(addresses, roles) if rr == r] for r in ("prefill", "decode", "colocated")}
        router = RouterActor.remote()
        cluster._actors.append(router)
        router_bind = cfg.router_host if started else "0.0.0.0"
        cluster.address, cluster.http_address = ray.get(
            router.start.remote(
                str(model_dir),
                by_role["prefill"],
                by_role["decode"],
                by_role["colocated"],
                router_bind,
                cfg.router_port,
                secret,
                max_model_len=cfg.engine.max_model_len,
                http_port=cfg.http_port,
                model_name=model_name,
                api_keys=cfg.api_keys,
                max_requests_per_worker=cfg.max_requests_per_worker,
                stream_interval=cfg.stream_interval,
                tls=cfg.tls,
                routing=cfg.routing,
                local_prefill_tokens=cfg.local_prefill_tokens,
                local_prefill_policy=cfg.local_prefill_policy,
                slo_ttft_ms=cfg.slo_ttft_ms if cfg.placement == "auto" else None,
                slo_tpot_ms=cfg.slo_tpot_ms if cfg.placement == "auto" else None,
            ),
            timeout=START_TIMEOUT_S,
        )
    except KeyboardInterrupt:
        cluster.stop()
        raise
    except Exception as exc:
        cluster.stop()
        raise RuntimeError(f"cluster failed to start: {_root_cause(exc)}") from exc

    def moved(old: str, new: str, role: str) -> None:
        cluster.workers.pop(old, None)
        cluster.workers[new] = role

    cluster.supervisor = Supervisor(
        [Supervised(a, r, args, addr) for a, r, args, addr in zip(actors, roles, start_args, addresses)],
        router,
        on_change=moved,
        max_restarts=WORKER_MAX_RESTARTS,
    )
    cluster.supervisor.start()
    log.info("cluster up in %.1fs: router %s, workers %s", time.monotonic() - t0, cluster.address, cluster.workers)
    return cluster


def _root_cause(exc: BaseException) -> str:
    """The worker's own exception for a Ray task error, else ``exc``."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        return f"{type(exc.cause).__name__}: {exc.cause}"
    return str(exc)


def _resolve_model(cfg: ClusterConfig):
    """Resolve the model once in the driver so every actor loads the same folder."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.engine.text.tokenizer import Tokenizer

    model_dir = resolve_model_dir(cfg.engine.model)
    ModelConfig.from_folder(model_dir)  # fail here, not in every actor, on a bad folder
    Tokenizer.from_folder(model_dir)
    return model_dir
