"""Routing policies over WorkerPool's bookkeeping (channels are made but never called) and the
prefix index's bounds."""

from __future__ import annotations

import pytest

from pdserve.engine.scheduling.prefix_hash import prefix_hashes
from pdserve.router.pool import BALANCE_ABS_REQUESTS, WorkerPool
from pdserve.router.prefix_index import PrefixIndex

BS = 16


def conversation(turn: int) -> list[int]:
    """A chat's prompt at ``turn``: every earlier turn's tokens plus 40 new ones."""
    return [(7 * i) % 1000 for i in range(40 * (turn + 1))]


def make_pool(routing: str = "prefix-aware", n: int = 2, role: str = "prefill") -> WorkerPool:
    addrs = [f"127.0.0.1:{9000 + i}" for i in range(n)]
    if role == "colocated":
        return WorkerPool([], [], addrs, routing=routing)
    return WorkerPool(
        addrs if role == "prefill" else ["127.0.0.1:8999"],
        addrs if role == "decode" else ["127.0.0.1:8998"],
        [],
        routing=routing,
    )


def route_prefill(pool: WorkerPool, prompt: list[int]):
    w = pool.pick_prefill(len(prompt), pool.prefix_of(prompt))
    pool.served(w, prompt)
    return w


async def test_turns_of_a_conversation_stay_on_one_worker_while_load_allows() -> None:
    pool = make_pool()
    first = route_prefill(pool, conversation(0))
    other = next(w for w in pool.workers if w.role == "prefill" and w is not first)
    for turn in range(1, 5):
        first.outstanding_prefill_tokens = 20  # busier than the other, but the prefix it holds is longer
        assert route_prefill(pool, conversation(turn)) is first
    other.outstanding_prefill_tokens = 0
    first.outstanding_prefill_tokens = 5000  # now its queue outweighs the cached prefix
    assert route_prefill(pool, conversation(5)) is other


async def test_least_loaded_ignores_the_prefix() -> None:
    pool = make_pool("least-loaded")
    first = route_prefill(pool, conversation(0))
    first.outstanding_prefill_tokens = 100
    assert route_prefill(pool, conversation(1)) is not first
    assert pool.prefix_of(conversation(1)) == []


async def test_colocated_follows_the_prefix_too() -> None:
    pool = make_pool(role="colocated")
    p = conversation(2)
    w = pool.pick_colocated(len(p), pool.prefix_of(p))
    pool.served(w, p)
    w.outstanding_prefill_tokens = 60
    nxt = conversation(3)
    assert pool.pick_colocated(len(nxt), pool.prefix_of(nxt)) is w
    assert pool.cached_tokens(w, len(nxt), pool.prefix_of(nxt)) == len(p) // BS * BS


async def test_decode_prefers_the_prefix_until_load_is_uneven() -> None:
    pool = make_pool(role="decode")
    holder, other = [w for w in pool.workers if w.role == "decode"]
    for w in (holder, other):
        w.free_kv_blocks, w.total_kv_blocks = 500, 500
    other.free_kv_blocks = 600  # least-loaded would pick it
    p = conversation(3)
    pool.served(holder, p)
    assert pool.pick_decode(len(p), pool.prefix_of(p)) is holder
    holder.active_requests, other.active_requests = BALANCE_ABS_REQUESTS + 4, 2
    assert pool.pick_decode(len(p), pool.prefix_of(p)) is other
    fresh = [999 - t for t in p]  # a prompt no worker holds: the one with the most room
    holder.active_requests = other.active_requests = 0
    assert pool.pick_decode(len(fresh), pool.prefix_of(fresh)) is other


def test_overlap_stops_at_the_first_missing_block_and_never_counts_the_last_token() -> None:
    index = PrefixIndex()
    hashes = prefix_hashes(list(range(64)), BS)
    index.add("w", hashes[:2])
    assert index.overlap("w", hashes) == 2
    index.add("w", hashes[3:])
    assert index.overlap("w", hashes) == 2  # block 2 is missing: later ones cannot be reused
    assert index.overlap("other", hashes) == 0


def test_index_entries_expire_and_stay_bounded() -> None:
    index = PrefixIndex(ttl_s=10.0, max_blocks=5)
    hashes = prefix_hashes(list(range(16 * 8)), BS)
    index.add("w", hashes[:3], now=0.0)
    assert index.overlap("w", hashes, now=5.0) == 3
    assert index.overlap("w", hashes, now=11.0) == 0
    index.add("w", hashes, now=20.0)  # 8 blocks into a bound of 5: the oldest go first
    assert index.size("w") == 5 and index.overlap("w", hashes, now=20.0) == 0
    index.forget("w")
    assert index.size("w") == 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        WorkerPool([], [], [], routing="random")


async def test_a_worker_that_caches_nothing_is_never_credited_with_a_prefix() -> None:
    """--no-prefix-caching workers report 0 cached blocks: the index must not send them a long
    prompt as if it were cached (nor to be prefilled on decode)."""
    pool = make_pool(role="decode")
    holder = next(w for w in pool.workers if w.role == "decode")
    p = conversation(3)
    pool.served(holder, p)
    assert pool.cached_tokens(holder, len(p), pool.prefix_of(p)) > 0
    holder.cached_kv_blocks = 0
    assert pool.cached_tokens(holder, len(p), pool.prefix_of(p)) == 0


async def test_auto_with_every_worker_decoding_picks_as_colocated_does() -> None:
    """With no prefill worker left (auto placement after a switch), each decode worker prefills its
    own requests: the pick follows the prefill queue, as a colocated pick does, not the free KV
    blocks."""
    pool = make_pool("least-loaded", role="decode")
    a, b = [w for w in pool.workers if w.role == "decode"]
    for w in pool.workers:
        w.switchable = True
    pool.workers[0].draining = True  # the prefill worker, switching to decode
    for w in (a, b):
        w.free_kv_blocks, w.total_kv_blocks, w.block_size = 500, 500, BS
    a.free_kv_blocks = 600  # more room, but a prompt is being prefilled there
    a.outstanding_prefill_tokens = 256
    assert pool.placement == "auto" and not pool.routable("prefill")
    assert pool.pick_decode(256) is b
    a.outstanding_prefill_tokens = 0
    assert pool.pick_decode(256) is a
    pool.workers[0].draining = False  # a prefill worker again: decode picks by room
    a.outstanding_prefill_tokens = 256
    assert pool.pick_decode(256) is a
