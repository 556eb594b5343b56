"""Preemption when a decode step needs a block the cache does not have: the newest sequence gives its blocks
back and is recomputed later, in admission order.

These cases pin the prefill-first policy (``chunked_prefill=False``); test_chunked_prefill.py covers the
chunked one."""

from __future__ import annotations

from pdserve.engine.scheduling.sequence import FinishReason, SequenceStatus
from tests.engine.scheduling._scheduler_sim import ids, make_scheduler, make_seq, step


def test_decode_preempts_the_most_recently_admitted_sequence() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    old = make_seq("old", 7, max_tokens=4)  # 8 positions: 2 blocks
    sched.add(old)
    step(sched)
    new = make_seq("new", 1, max_tokens=4)  # 2 positions: 1 block
    sched.add(new)
    step(sched)
    assert sched.blocks.num_free == 0
    assert ids(step(sched).seqs) == ["old", "new"]  # old: 9 tokens, needs a third block next step
    batch = step(sched)
    # old cannot grow; new (admitted last) gives its block back although it needed none
    assert ids(batch.seqs) == ["old"]
    assert len(old.block_table) == 3
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_output_tokens == 2
    assert ids(sched.waiting) == ["new"] and ids(sched.running) == ["old"]
    kept = list(new.token_ids)
    # no room to re-prefill new until old finishes
    batch = step(sched)
    assert not batch.is_prefill and ids(batch.seqs) == ["old"]
    assert old.finish_reason is FinishReason.LENGTH and sched.blocks.num_used == 0
    # new is recomputed from its prompt and the tokens it already produced
    batch = step(sched)
    assert batch.is_prefill and ids(batch.seqs) == ["new"]
    assert new.token_ids[:-1] == kept
    assert len(new.block_table) == sched.blocks.blocks_for(len(kept) + 1)
    while sched.has_work():
        step(sched)
    assert new.num_output_tokens == 4 and sched.blocks.num_used == 0


def test_decode_preempts_the_current_sequence_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_seq("a", 1), make_seq("b", 7)  # 1 + 2 blocks: the cache is full after prefill
    sched.add(a)
    sched.add(b)
    assert ids(step(sched).seqs) == ["a", "b"]
    assert ids(step(sched).seqs) == ["a", "b"]  # b now has 9 tokens
    batch = step(sched)
    assert ids(batch.seqs) == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert ids(sched.waiting) == ["b"] and ids(sched.running) == ["a"]


def test_several_preemptions_keep_admission_order_in_waiting() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    seqs = [make_seq(f"r{i}", 1) for i in range(4)]  # 2 positions each: one block each
    for s in seqs:
        sched.add(s)
    step(sched)  # prefill all four: cache full, 2 tokens each
    batch = step(sched)  # 2 positions each: no growth yet
    assert ids(batch.seqs) == ["r0", "r1", "r2", "r3"]
    batch = step(sched)  # 3 positions each: r0 and r1 need 2 blocks, r3 then r2 are preempted
    assert ids(batch.seqs) == ["r0", "r1"]
    assert ids(sched.waiting) == ["r2", "r3"]
    assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in seqs[2:])
