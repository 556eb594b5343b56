"""Ray actors that host the gRPC servers. Each actor runs its server on the actor's event loop."""

from __future__ import annotations

import logging
import os

import ray

from pdserve.worker.cpus import pin_process, process_affinity


def _advertised_host(bind_host: str) -> str:
    """Address other processes use: the node IP when bound to all interfaces, else the bind host."""
    return ray.util.get_node_ip_address() if bind_host == "0.0.0.0" else bind_host


def _set_secret(secret: str | None) -> None:
    """Every pdserve server and internal channel of this actor's process reads the secret from here."""
    from pdserve.rpc.auth import SECRET_ENV

    if secret:
        os.environ[SECRET_ENV] = secret


@ray.remote
class WorkerActor:
    """One worker process; its role (or first role, when switchable) is given to ``start``."""

    def __init__(self) -> None:
        self.running = None
        self.advertised: str | None = None

    def address(self) -> str | None:
        """The advertised "host:port" once started; None in a fresh (or Ray-restarted) process."""
        return self.advertised

    def pid(self) -> int:
        return os.getpid()

    async def start(
        self,
        role: str,
        engine_cfg,
        bind_host: str,
        cpus: list[int] | None = None,
        secret: str | None = None,
        switchable: bool = False,
    ) -> str:
        """Build the engine, serve the role's gRPC services; returns the advertised "host:port".

        ``cpus``: pin this process (and the engine and torch threads it starts) to these CPU ids.
        ``secret``: the cluster secret every internal call must carry (auth.SECRET_ENV).
        ``switchable``: a switchable worker (``pdserve.switchable_worker``) starting as ``role``."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        _set_secret(secret)
        if cpus:
            pin_process(cpus)
            logging.getLogger(__name__).info("%s worker pinned to CPUs %s", role, cpus)
        if switchable:
            from functools import partial

            from pdserve.switchable_worker.worker import serve

            serve = partial(serve, role=role)
        elif role == "prefill":
            from pdserve.prefill_worker.worker import serve
        elif role == "decode":
            from pdserve.decode_worker.worker import serve
        else:
            from pdserve.colocated_worker.worker import serve
        self.running = await serve(engine_cfg, bind_host, 0)
        self.advertised = f"{_advertised_host(bind_host)}:{self.running.address.rsplit(':', 1)[1]}"
        return self.advertised

    def affinity(self) -> list[int]:
        """CPU ids any thread of this worker's process may run on (Linux)."""
        return process_affinity()

    async def stop(self) -> None:
        if self.running is not None:
            await self.running.stop()


@ray.remote(num_cpus=0)
class RouterActor:
    """The client-facing router."""

    def __init__(self) -> None:
        self.running = None

    async def start(
        self,
        model_dir: str,
        prefill: list[str],
        decode: list[str],
        colocated: list[str],
        bind_host: str,
        port: int,
        secret: str | None = None,
        **options,
    ) -> tuple[str, str | None]:
        """Serve (``options``: the keyword arguments of ``pdserve.router.grpc_api.serve``); returns
        the advertised gRPC "host:port" and the HTTP one (None without HTTP)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        _set_secret(secret)
        from pdserve.router.grpc_api import serve

        self.running = r = await serve(model_dir, prefill, decode, colocated, bind_host, port, **options)
        host = _advertised_host(bind_host)
        http = f"{host}:{r.http_address.rsplit(':', 1)[1]}" if r.http_address else None
        return f"{host}:{r.address.rsplit(':', 1)[1]}", http

    async def worker_restarting(self, address: str) -> None:
        """The worker at ``address`` died and Ray is restarting it."""
        self.running.core.pool.restarting(address)

    async def replace_worker(self, old: str, new: str, role: str) -> None:
        """A restarted worker serves at ``new`` instead of ``old``."""
        await self.running.core.pool.replace(old, new, role)

    async def stop(self) -> None:
        if self.running is not None:
            await self.running.stop()
