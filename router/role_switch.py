"""Run-time role switching for ``--placement auto``: the router measures, decides (``RoleBalancer``)
and switches a worker in place.

A switch drains first: the worker leaves routing (``WorkerHandle.draining``), the requests it holds
run on (a switchable worker finishes every call it accepted, whatever its role) until none is left
or ``drain_timeout_s`` passes, then ``SetRole`` flips it and it takes requests of its new role.
While it drains, the other workers serve; the balancer never drains the last decode worker, and
with no prefill worker the decode workers prefill locally (router/local_prefill.py), so no request
waits for a role to come back. A failed SetRole puts the worker back in its old role. Every switch
is logged and counted (``pdserve:role_switches_total{from_role,to_role}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from pdserve.router.role_balancer import Move, RoleBalancer, WorkerLoad
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)
WINDOW_S = 1.0
LATENCY_WINDOW_S = 5.0  # the latency p90s cover the requests completed this long before a decision
DRAIN_TIMEOUT_S = 30.0
SET_ROLE_TIMEOUT_S = 5.0


class RoleRebalancer:
    """Feeds the pool's switchable workers' busy time and the TTFT and TPOT p90 of the requests
    completed (``observe_request``) to ``balancer`` every ``window_s`` seconds (``on_refresh``, run after each
    stats poll) and carries out its moves one at a time.
    ``on_switch(from_role, to_role)`` is called after each done switch."""

    def __init__(
        self,
        pool,
        balancer: RoleBalancer | None = None,
        window_s: float = WINDOW_S,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        on_switch: Callable[[str, str], None] | None = None,
        start_s: float | None = None,
    ) -> None:
        """``start_s``: when the first window starts, in the seconds ``decide`` is given (default
        now, ``time.monotonic``; the simulator passes virtual time)."""
        self.pool = pool
        self.balancer = balancer or RoleBalancer()
        self.window_s, self.drain_timeout_s = window_s, drain_timeout_s
        self.on_switch = on_switch or (lambda a, b: None)
        self._last: dict[str, tuple[int, int]] = {}  # address -> busy ns at the window's start
        self._window_start = time.monotonic() if start_s is None else start_s
        self._latencies: deque[tuple[float, float, float | None]] = deque()  # (done at, TTFT s, TPOT s)
        self.task: asyncio.Task | None = None  # the switch under way

    def observe_request(self, ttft_ns: float, tpot_ns: float | None, at_s: float | None = None) -> None:
        """A request completed at ``at_s`` (default now, ``time.monotonic``) with this TTFT and TPOT
        (None for one token) at the router, nanoseconds (``pdserve.router.timings``' definitions)."""
        if len(self._latencies) < 100_000:  # a bound; the p90 of a sample that large is the same
            at = time.monotonic() if at_s is None else at_s
            self._latencies.append((at, ttft_ns / 1e9, None if tpot_ns is None else tpot_ns / 1e9))

    def latency_p90s(self, now_s: float) -> tuple[float | None, float | None]:
        """TTFT and TPOT p90 (seconds) of the requests completed in the last ``LATENCY_WINDOW_S``;
        None for either with fewer than 5 values (too few to judge)."""
        while self._latencies and self._latencies[0][0] < now_s - LATENCY_WINDOW_S:
            self._latencies.popleft()

        def p90(values: list[float]) -> float | None:
            values = sorted(values)
            return values[int(0.9 * (len(values) - 1))] if len(values) >= 5 else None

        return p90([x[1] for x in self._latencies]), p90([x[2] for x in self._latencies if x[2] is not None])

    def loads(self, elapsed_s: float) -> list[WorkerLoad]:
        """Each healthy switchable worker's busy shares since the last window (and a new window)."""
        out = []
        for w in self.pool.workers:
            if not (w.switchable and w.healthy):
                continue
            p0, d0 = self._last.get(w.address, (w.prefill_busy_ns, w.decode_busy_ns))
            dp, dd = max(w.prefill_busy_ns - p0, 0), max(w.decode_busy_ns - d0, 0)  # a restart resets them
            out.append(WorkerLoad(w.address, w.role, dp / 1e9 / elapsed_s, dd / 1e9 / elapsed_s))
            self._last[w.address] = (w.prefill_busy_ns, w.decode_busy_ns)
        return out

    def decide(self, now_s: float, switching: bool = False) -> Move | None:
        """At ``now_s``: once a window has passed, its loads and latency p90s go to the balancer; its move
        (None before the window ends, or while ``switching``)."""
        if now_s - self._window_start < self.window_s:
            return None
        loads, self._window_start = self.loads(now_s - self._window_start), now_s
        return self.balancer.observe(now_s, loads, switching, *self.latency_p90s(now_s))

    async def on_refresh(self) -> None:
        move = self.decide(time.monotonic(), self.task is not None and not self.task.done())
        if move is not None:
            self.task = asyncio.create_task(self.switch(move))

    async def switch(self, move: Move) -> bool:
        """Drain ``move.address``, SetRole, route to it in its new role; True when it switched."""
        w = next((w for w in self.pool.workers if w.address == move.address), None)
        if w is None or w.role != move.from_role:
            self.balancer.switched(time.monotonic())
            return False
        log.info(
            "role switch (%s): %s %s -> %s (bottleneck utilisation %.2f, predicted %.2f); draining %d requests",
            move.reason,
            w.address,
            move.from_role,
            move.to_role,
            move.bottleneck,
            move.predicted,
            w.active_requests,
        )
        w.draining = True
        try:
            deadline = time.monotonic() + self.drain_timeout_s
            while w.active_requests > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            try:
                await w.admin.SetRole(worker_pb2.SetRoleRequest(role=move.to_role), timeout=SET_ROLE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("role switch of %s failed (%s); it stays %s", w.address, exc.details(), move.from_role)
                return False
            w.role = move.to_role
        finally:
            w.draining = False
            self.balancer.switched(time.monotonic())
        self.on_switch(move.from_role, move.to_role)
        log.info("role switch: %s is now %s", w.address, move.to_role)
        return True

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
