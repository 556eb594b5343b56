"""The router's view of the workers: channels, load counters, and the routing policies."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.engine.scheduling.prefix_hash import BlockHash, prefix_hashes
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.worker_handle import WorkerHandle
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.1
UNHEALTHY_AFTER_FAILURES = 3  # consecutive failed polls before a worker leaves the routing set
ROUTING_POLICIES = ("least-loaded", "prefix-aware")
# Decode picks follow the cached prefix unless load is this uneven (SGLang's cache-aware router's
# rule: both an absolute and a relative gap in requests held).
BALANCE_ABS_REQUESTS = 8
BALANCE_REL = 1.5
RESTART_WAIT_S = 30.0  # how long a worker Ray is restarting keeps requests waiting for it (migrations included)


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of the needed role (maps to UNAVAILABLE)."""


class Overloaded(RuntimeError):
    """Every healthy worker of the needed role holds ``max_requests_per_worker`` requests (maps to
    RESOURCE_EXHAUSTED, with a retry hint)."""

    retry_after_s = 1.0


class WorkerPool:
    """Workers by role plus the routing policies (``routing``):

    ``least-loaded``:
      - prefill: least outstanding prefill tokens (ties: fewer active requests);
      - decode: most free KV blocks (ties: fewer active requests);
      - colocated: least outstanding prefill tokens, then fewest active requests.
    ``prefix-aware`` (the default) keeps a ``PrefixIndex`` of the blocks each worker was sent:
      - prefill and colocated: the least tokens to compute before this request's first token, its
        queue plus its prompt minus the prefix the worker holds (Dynamo's KV router's cost, in
        tokens), so a held prefix wins until the worker's queue outweighs it;
      - decode: the worker holding the longest prefix, unless the requests held differ by more than
        ``BALANCE_ABS_REQUESTS`` and ``BALANCE_REL`` times, then the least-loaded (SGLang's rule).
    Under ``auto`` placement with no prefill worker routable, every decode worker prefills its own
    requests, and a decode pick follows the colocated rule of the routing policy.

    ``max_requests_per_worker`` (0: none) bounds the requests a decode or colocated worker holds;
    past it on every worker, a new request is refused (Overloaded) instead of queuing without end.
    """

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        colocated: list[str],
        max_requests_per_worker: int = 0,
        routing: str = "prefix-aware",
    ) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {routing!r}; choose {' or '.join(ROUTING_POLICIES)}")
        self.routing = routing
        self.prefix = PrefixIndex()
        self._restarting: dict[str, float] = {}  # address -> monotonic time until which its restart is awaited
        self.workers = (
            [WorkerHandle.connect("prefill", a) for a in prefill]
            + [WorkerHandle.connect("decode", a) for a in decode]
            + [WorkerHandle.connect("colocated", a) for a in colocated]
        )
        self._poller: asyncio.Task | None = None
        self.on_refresh: list = []  # async callables run after each stats poll
        self.max_requests_per_worker = max_requests_per_worker  # 0: no bound

    @property
    def placement(self) -> str:
        """``colocated``, ``split``, or ``auto`` (switchable workers, whose roles may change)."""
        if any(w.switchable for w in self.workers):
            return "auto"
        return "colocated" if any(w.role == "colocated" for w in self.workers) else "split"

    def routable(self, role: str) -> list[WorkerHandle]:
        """Healthy workers of ``role`` that take new requests (not draining)."""
        return [w for w in self.workers if w.role == role and w.healthy and not w.draining]

    def _candidates(self, role: str) -> list[WorkerHandle]:
        ws = self.routable(role)
        if not ws:
            raise NoWorkerAvailable(f"no healthy {role} worker is available")
        return ws

    def call_failed(self, w: WorkerHandle, exc: grpc.aio.AioRpcError) -> None:
        """A call to ``w`` failed: UNAVAILABLE (connection refused or lost) takes it out of routing
        at once; its next answered stats poll brings it back."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and w.healthy:
            log.warning("worker %s %s unreachable: %s; routing around it", w.role, w.address, exc.details())
            w.healthy = False

    def roles_without_healthy_worker(self) -> list[str]:
        """The roles this placement needs that have no healthy worker now ([] when ready)."""
        needed = {"colocated": ("colocated",), "auto": ("decode",)}.get(self.placement, ("prefill", "decode"))
        return [r for r in needed if not self.routable(r)]

    @property
    def block_size(self) -> int:
        return next((w.block_size for w in self.workers if w.block_size), 16)

    def prefix_of(self, token_ids: list[int]) -> list[BlockHash]:
        """Names of the prompt's full blocks ([] under least-loaded routing: nothing is indexed)."""
        return prefix_hashes(token_ids, self.block_size) if self.routing == "prefix-aware" else []

    def cached_tokens(self, w: WorkerHandle, n: int, hashes: list[BlockHash]) -> int:
        """Prompt tokens of ``n`` that ``w`` is believed to hold (never the last one: it is computed;
        0 when ``hashes`` is empty, as under least-loaded routing, or the worker caches nothing,
        as with --no-prefix-caching)."""
        if w.cached_kv_blocks == 0:
            return 0
        return min(
            self.prefix.overlap(w.address, hashes) * self.block_size, (n - 1) // self.block_size * self.block_size
        )

    def _pick_by_tokens(self, ws: list[WorkerHandle], n: int, hashes: list[BlockHash]) -> WorkerHandle:
        if not hashes:
            return min(ws, key=lambda w: (w.outstanding_prefill_tokens, w.active_requests))
        return min(
            ws, key=lambda w: (w.outstanding_prefill_tokens + n - self.cached_tokens(w, n, hashes), w.active_requests)
        )

    def pick_prefill(self, n: int = 0, hashes: list[BlockHash] = ()) -> WorkerHandle:
        """The prefill worker for an ``n``-token prompt whose full blocks are named ``hashes``."""
        return self._pick_by_tokens(self._candidates("prefill"), n, list(hashes))

    def _with_room(self, role: str) -> list[WorkerHandle]:
        """Healthy workers of ``role`` below the request bound; Overloaded when there is none."""
        ws = self._candidates(role)
        bound = self.max_requests_per_worker
        room = [w for w in ws if not bound or w.active_requests < bound]
        if not room:
            raise Overloaded(
                f"every {role} worker holds {bound} request{'s' if bound != 1 else ''} (--max-requests-per-worker); "
                f"retry in {Overloaded.retry_after_s:g}s"
            )
        return room

    def pick_decode(self, n: int = 0, hashes: list[BlockHash] = ()) -> WorkerHandle:
        """The decode worker for an ``n``-token prompt (see the class docstring)."""
        ws = self._with_room("decode")
        if self.placement == "auto" and not self.routable("prefill"):
            # every worker prefills its own requests (colocated placement): colocated's rule
            return self._pick_by_tokens(ws, n, list(hashes))
        by_room = max(ws, key=lambda w: (w.free_kv_blocks - w.routed_blocks_since_poll, -w.active_requests))
        if not hashes or len(ws) == 1:
            return by_room
        loads = [w.active_requests for w in ws]
        if max(loads) - min(loads) > BALANCE_ABS_REQUESTS and max(loads) > BALANCE_REL * min(loads):
            return min(ws, key=lambda w: (w.active_requests, -(w.free_kv_blocks - w.routed_blocks_since_poll)))
        held = {id(w): self.cached_tokens(w, n, list(hashes)) for w in ws}
        best = max(ws, key=lambda w: (held[id(w)], w is by_room, -w.active_requests))
        return best if held[id(best)] else by_room

    def pick_colocated(self, n: int = 0, hashes: list[BlockHash] = ()) -> WorkerHandle:
        """The colocated worker for an ``n``-token prompt (see the class docstring)."""
        return self._pick_by_tokens(self._with_room("colocated"), n, list(hashes))

    def served(self, w: WorkerHandle, token_ids: list[int]) -> None:
        """``w`` computed (or was sent) the KV of ``token_ids``: index its full blocks."""
        if self.routing == "prefix-aware":
            self.prefix.add(w.address, prefix_hashes(token_ids, self.block_size))

    async def refresh(self) -> None:
        """Poll every worker's GetStats once; a failing worker is marked unhealthy until it answers."""

        async def one(w: WorkerHandle) -> None:
            try:
                s = await w.admin.GetStats(worker_pb2.GetStatsRequest(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                w.failed_polls += 1
                if w.healthy and w.failed_polls >= UNHEALTHY_AFTER_FAILURES:
                    why = f"{w.failed_polls} failed polls: {exc.code().name}"
                    log.warning("worker %s %s unhealthy after %s", w.role, w.address, why)
                    w.healthy = False
                return
            w.apply_stats(s)

        await asyncio.gather(*(one(w) for w in self.workers))

    def restarting(self, address: str) -> None:
        """The worker at ``address`` died and Ray is restarting it: requests that need its pool wait
        for it (``restart_pending``) for up to ``RESTART_WAIT_S`` instead of failing."""
        self._restarting[address] = time.monotonic() + RESTART_WAIT_S

    def restart_pending(self) -> bool:
        now = time.monotonic()
        return any(t > now for t in self._restarting.values())

    async def replace(self, old: str, new: str, role: str) -> None:
        """The worker that served at ``old`` (dead) now serves at ``new``: route to it from now on. It
        takes ``old``'s place in ``workers``, so its metrics label (``worker_labels``) stays the same."""
        self._restarting.pop(old, None)
        fresh = WorkerHandle.connect(role, new)
        self.prefix.forget(old)  # a restarted worker's cache is empty
        for i, w in enumerate(self.workers):
            if w.address == old:
                self.workers[i] = fresh
                await w.close()
                break
        else:
            self.workers.append(fresh)
        log.warning("worker %s %s replaced by %s", role, old, new)
        await self.refresh()

    async def start(self) -> None:
        """First stats poll, then polling. RuntimeError when the workers serve different models
        (same shapes, other weights or tokenizer: their KV would decode into wrong tokens)."""
        await self.refresh()
        models = {w.fingerprint for w in self.workers if w.fingerprint}
        if len(models) > 1:
            by = ", ".join(f"{w.role}@{w.address}: {w.fingerprint[:12]}" for w in self.workers)
            raise RuntimeError(
                f"the workers serve different models (model fingerprints {by}); give every worker the same model "
                "folder, --dtype and --quantization"
            )
        self._poller = asyncio.create_task(self._poll())

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the smallest KV cache among the workers can hold (None before any stats)."""
        sizes = [w.total_kv_blocks * w.block_size for w in self.workers if w.total_kv_blocks]
        return min(sizes) if sizes else None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self.refresh()
            for listener in self.on_refresh:
                await listener()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for w in self.workers:
            await w.close()
