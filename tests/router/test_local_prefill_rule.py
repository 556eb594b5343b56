"""The split backend's local-prefill rule (conditional disaggregation) as a pure function, the one
``SplitBackend`` and ``pdserve simulate`` both call: the ``prefix`` and ``load-aware`` policies."""

from __future__ import annotations

import pytest

from pdserve.router.local_prefill import LocalPrefill, local_prefill_reason
from pdserve.router.pool import WorkerHandle, WorkerPool

PREFIX_32 = LocalPrefill(32, "prefix")


def pool_of(routing: str = "prefix-aware", prefill: int = 0, switchable: bool = False):
    pool = WorkerPool([], [], [], routing=routing)
    w = WorkerHandle("decode", "decode-0", None, block_size=16, switchable=switchable)
    w.free_kv_blocks = w.total_kv_blocks = 100
    ps = [WorkerHandle("prefill", f"prefill-{i}", None, block_size=16, switchable=switchable) for i in range(prefill)]
    pool.workers = [w, *ps]
    return pool, w, ps


def test_decode_prefills_what_it_mostly_holds():
    pool, w, _ = pool_of(prefill=1)
    prompt = list(range(100, 164))  # 64 tokens, 4 blocks
    hashes = pool.prefix_of(prompt)
    assert local_prefill_reason(pool, w, 64, hashes, PREFIX_32) is None  # holds nothing: 64 > 32 to compute
    pool.served(w, prompt[:48])  # 3 blocks held: 16 tokens left
    assert local_prefill_reason(pool, w, 64, hashes, PREFIX_32) == "short"
    assert local_prefill_reason(pool, w, 64, hashes, LocalPrefill(15, "prefix")) is None
    assert local_prefill_reason(pool, w, 64, hashes, LocalPrefill(0, "prefix")) is None  # 0: only when busy
    assert w.active_requests == 0 and w.outstanding_prefill_tokens == 0  # nothing changed


def test_short_prompt_or_least_loaded_routing():
    pool, w, _ = pool_of("least-loaded", prefill=1)
    prompt = list(range(100, 164))
    pool.served(w, prompt)  # least-loaded indexes nothing
    assert pool.prefix_of(prompt) == []
    assert local_prefill_reason(pool, w, 64, [], PREFIX_32) is None
    assert local_prefill_reason(pool, w, 20, [], PREFIX_32) == "short"  # a prompt under the threshold


def test_load_aware_prefills_locally_only_while_every_prefill_worker_is_behind():
    pool, w, (p0, p1) = pool_of(prefill=2)
    rule = LocalPrefill(32, "load-aware", busy_prefill_tokens=1024, decode_prefill_tokens=512)
    assert local_prefill_reason(pool, w, 256, [], rule) is None  # prefill pool idle
    p0.outstanding_prefill_tokens = 2048
    assert local_prefill_reason(pool, w, 256, [], rule) is None  # p1 still has room
    p1.outstanding_prefill_tokens = 1024
    assert local_prefill_reason(pool, w, 256, [], rule) == "prefill_busy"
    assert local_prefill_reason(pool, w, 256, [], LocalPrefill(32, "prefix")) is None  # the other policy never
    p1.draining = True  # a draining worker takes nothing: p0 alone decides
    assert local_prefill_reason(pool, w, 256, [], rule) == "prefill_busy"


def test_load_aware_vetoes_a_decode_worker_without_room():
    pool, w, (p0,) = pool_of(prefill=1)
    p0.outstanding_prefill_tokens = 4096
    rule = LocalPrefill(32, "load-aware", busy_prefill_tokens=1024, decode_prefill_tokens=512, min_free_kv=0.25)
    w.outstanding_prefill_tokens = 300  # one local prefill under way: 300 + 256 > 512
    assert local_prefill_reason(pool, w, 256, [], rule) is None
    w.outstanding_prefill_tokens = 0
    w.free_kv_blocks = 40  # 40 - 17 blocks for this request = 23 < 25% of 100
    assert local_prefill_reason(pool, w, 256, [], rule) is None
    w.free_kv_blocks = 60
    assert local_prefill_reason(pool, w, 256, [], rule) == "prefill_busy"


def test_without_a_prefill_worker_only_auto_placement_prefills_locally():
    pool, w, _ = pool_of(prefill=0, switchable=True)
    assert pool.placement == "auto" and pool.roles_without_healthy_worker() == []
    assert local_prefill_reason(pool, w, 256, [], LocalPrefill(0, "prefix")) == "no_prefill_worker"
    pool, w, _ = pool_of(prefill=0)  # fixed split whose prefill worker is gone: wait for it, as before
    assert pool.roles_without_healthy_worker() == ["prefill"]
    assert local_prefill_reason(pool, w, 256, [], LocalPrefill(0, "prefix")) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": "sometimes"}, {"tokens": -1}, {"busy_prefill_tokens": -5}, {"min_free_kv": 1.5}],
)
def test_bad_rules_are_refused_with_a_message(kwargs):
    with pytest.raises(ValueError, match="local.prefill"):
        LocalPrefill(**kwargs)
