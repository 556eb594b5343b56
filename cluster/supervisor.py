"""Keeps a cluster's workers alive: Ray restarts a dead worker actor (``max_restarts``, Ray's own
backoff); this supervisor starts the restarted actor's server again and tells the router the new
address, so the router never needs a restart of its own.

It runs as a thread in the process that started the cluster. Every ``interval_s`` it asks each
worker actor for its address: an actor that does not answer is dead or restarting (logged once);
an answering actor with no server is a restarted one, which gets ``start`` with the arguments it
was first started with, and the router swaps the dead address for the new one. Between the death
and that swap, the router has already taken the dead worker out of routing (its failed calls and
stats polls mark it down).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import ray

log = logging.getLogger(__name__)
PING_TIMEOUT_S = 2.0


@dataclass
class Supervised:
    """One worker actor: how it was started, and where it serves now."""

    actor: object
    role: str
    start_args: tuple
    address: str
    down_since: float | None = None
    gone: bool = False  # Ray will not restart it again


class Supervisor:
    """See the module docstring. ``on_change(old, new, role)`` runs after each replacement."""

    def __init__(
        self,
        workers: list[Supervised],
        router,
        interval_s: float = 0.5,
        start_timeout_s: float = 600.0,
        on_change=None,
        max_restarts: int | None = None,
    ) -> None:
        self.max_restarts = max_restarts
        self.workers, self.router, self.interval_s = workers, router, interval_s
        self.start_timeout_s, self.on_change = start_timeout_s, on_change
        self.recoveries: list[tuple[str, str, float]] = []  # (old, new, seconds down)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.start_timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for w in self.workers:
                if self._stop.is_set():
                    return
                try:
                    self._check(w)
                except Exception as exc:  # the supervisor must outlive any one failure
                    log.warning("supervising %s worker %s: %s", w.role, w.address, exc)

    def _check(self, w: Supervised) -> None:
        try:
            address = ray.get(w.actor.address.remote(), timeout=PING_TIMEOUT_S)
        except ray.exceptions.ActorDiedError:
            if not w.gone:  # Ray's restart budget is spent: it will not come back
                w.gone = True
                log.error(
                    "%s worker %s is dead for good (its %s restarts are used up); restart pdserve serve to get it back",
                    w.role,
                    w.address,
                    self.max_restarts,
                )
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            if w.down_since is None:
                w.down_since = time.monotonic()
                log.warning(
                    "%s worker %s is down (%s); waiting for Ray to restart it", w.role, w.address, type(exc).__name__
                )
                self.router.worker_restarting.remote(w.address)  # its requests wait for it, not fail
            return
        if address is not None:
            if w.down_since is not None:  # it was only out of reach (a cut link, a stalled node): not restarted
                log.warning(
                    "%s worker %s answers again after %.1fs; it was not restarted",
                    w.role,
                    w.address,
                    time.monotonic() - w.down_since,
                )
                w.down_since = None  # so its next fall is reported again, and timed from then
            return
        # restarted by Ray: a fresh process without a server
        down_since = w.down_since or time.monotonic()
        new = ray.get(w.actor.start.remote(*w.start_args), timeout=self.start_timeout_s)
        ray.get(self.router.replace_worker.remote(w.address, new, w.role), timeout=30)
        seconds = time.monotonic() - down_since
        log.warning("%s worker recovered: %s replaces %s, %.1fs after it went down", w.role, new, w.address, seconds)
        self.recoveries.append((w.address, new, seconds))
        old, w.address, w.down_since = w.address, new, None
        if self.on_change is not None:
            self.on_change(old, new, w.role)
