"""The split backend's local-prefill rule (conditional disaggregation) as a pure function, the one
``SplitBackend`` and ``pdserve simulate`` both call."""

from __future__ import annotations

from pdserve.router.pool import WorkerHandle, WorkerPool
from pdserve.router.split_backend import prefills_on_decode


def pool_of(routing: str = "prefix-aware") -> tuple[WorkerPool, WorkerHandle]:
    pool = WorkerPool([], [], [], routing=routing)
    w = WorkerHandle("decode", "decode-0", None, block_size=16)
    pool.workers = [w]
    return pool, w


def test_decode_prefills_what_it_mostly_holds():
    pool, w = pool_of()
    prompt = list(range(100, 164))  # 64 tokens, 4 blocks
    hashes = pool.prefix_of(prompt)
    assert not prefills_on_decode(pool, w, 64, hashes, 32)  # holds nothing: 64 > 32 to compute
    pool.served(w, prompt[:48])  # 3 blocks held: 16 tokens left
    assert prefills_on_decode(pool, w, 64, hashes, 32)
    assert not prefills_on_decode(pool, w, 64, hashes, 15)
    assert not prefills_on_decode(pool, w, 64, hashes, 0)  # 0: always split
    assert pool.workers == [w] and w.active_requests == 0  # nothing changed


def test_short_prompt_or_least_loaded_routing():
    pool, w = pool_of("least-loaded")
    prompt = list(range(100, 164))
    pool.served(w, prompt)  # least-loaded indexes nothing
    assert pool.prefix_of(prompt) == []
    assert not prefills_on_decode(pool, w, 64, [], 32)
    assert prefills_on_decode(pool, w, 20, [], 32)  # a prompt under the threshold
