"""The router's approximate index of which KV blocks each worker holds, for prefix-aware routing.

Each worker's entry is a bounded LRU set of block hashes (``engine.scheduling.prefix_hash``: a
hash chained to the parent block, so one hash names a whole prefix) that the router has sent it,
forgotten after ``ttl_s`` or when more than ``max_blocks`` are held. It is approximate by design,
like SGLang's cache-aware router and Dynamo's KV router in approximate mode: the worker may have
evicted a block the index still lists, or cached one it never saw; a wrong guess costs a
recomputation, never a wrong token (the worker's own cache checks tokens).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from pdserve.engine.scheduling.prefix_hash import BlockHash

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_BLOCKS = 1 << 16  # per worker: 16 MiB-ish of keys; more than a CPU worker's KV cache holds


class PrefixIndex:
    """Block hashes per worker address. Not thread-safe (the router's event loop owns it)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        self._by_worker: dict[str, OrderedDict[BlockHash, float]] = {}

    def overlap(self, worker: str, hashes: list[BlockHash], now: float | None = None) -> int:
        """Leading blocks of ``hashes`` the worker is believed to hold (stops at the first miss)."""
        held = self._by_worker.get(worker)
        if not held:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        for h in hashes:
            seen = held.get(h)
            if seen is None or now - seen > self.ttl_s:
                break
            n += 1
        return n

    def add(self, worker: str, hashes: list[BlockHash], now: float | None = None) -> None:
        """The worker now holds these blocks (it was sent them, or computed them)."""
        held = self._by_worker.setdefault(worker, OrderedDict())
        now = time.monotonic() if now is None else now
        for h in hashes:
            held[h] = now
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)
        while held:  # expire from the oldest end
            h, seen = next(iter(held.items()))
            if now - seen <= self.ttl_s:
                break
            held.popitem(last=False)

    def forget(self, worker: str) -> None:
        """The worker restarted or left: its cache is gone."""
        self._by_worker.pop(worker, None)

    def size(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))
