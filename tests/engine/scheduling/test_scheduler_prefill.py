"""Prefill batches: FIFO within the token budget, the KV blocks a prompt needs, prefill before decode.

These cases pin the prefill-first policy (``chunked_prefill=False``); test_chunked_prefill.py covers the
chunked one."""

from __future__ import annotations

from pdserve.engine.scheduling.sequence import FinishReason, SequenceStatus
from tests.engine.scheduling._scheduler_sim import ids, make_scheduler, make_seq, step


def test_prefill_batch_respects_token_budget_in_fifo_order() -> None:
    sched = make_scheduler(max_num_batched_tokens=12)
    for i in range(4):
        sched.add(make_seq(f"r{i}", 5))
    first = sched.schedule()
    assert first.is_prefill and ids(first.seqs) == ["r0", "r1"]
    second = sched.schedule()
    assert second.is_prefill and ids(second.seqs) == ["r2", "r3"]
    for batch in (first, second):
        assert sum(s.num_tokens for s in batch.seqs) <= 12
        assert all(s.status is SequenceStatus.RUNNING for s in batch.seqs)
    assert ids(sched.running) == ["r0", "r1", "r2", "r3"]
    assert not sched.waiting


def test_prompt_longer_than_the_budget_runs_alone() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_seq("long", 20))
    sched.add(make_seq("short", 2))
    batch = sched.schedule()
    assert batch.is_prefill and ids(batch.seqs) == ["long"]
    assert ids(sched.schedule().seqs) == ["short"]


def test_prefill_allocates_prompt_plus_one_and_stops_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b, c = make_seq("a", 7), make_seq("b", 8), make_seq("c", 1)
    for seq in (a, b, c):  # a: 8 positions, 2 blocks; b: 9 positions, 3 blocks; c: 2 positions, 1 block
        sched.add(seq)
    batch = step(sched)
    # b does not fit in the 2 blocks left; c would, but prefill is FIFO and stops at b
    assert batch.is_prefill and ids(batch.seqs) == ["a"]
    assert len(a.block_table) == 2 and sched.blocks.num_free == 2
    assert ids(sched.waiting) == ["b", "c"]
    assert all(s.status is SequenceStatus.WAITING and s.block_table == [] for s in (b, c))
    batch = step(sched)
    assert not batch.is_prefill and ids(batch.seqs) == ["a"]
    sched.finish(a, FinishReason.ABORT)
    batch = sched.schedule()
    assert batch.is_prefill and ids(batch.seqs) == ["b", "c"]
    assert (len(b.block_table), len(c.block_table)) == (3, 1)
    assert sched.blocks.num_free == 0


def test_prefill_goes_before_decode() -> None:
    sched = make_scheduler()
    sched.add(make_seq("old", 3))
    step(sched)
    assert not step(sched).is_prefill
    sched.add(make_seq("new", 3))
    batch = step(sched)
    assert batch.is_prefill and ids(batch.seqs) == ["new"]
    batch = step(sched)
    assert not batch.is_prefill and ids(batch.seqs) == ["old", "new"]
