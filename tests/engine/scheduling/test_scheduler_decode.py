"""Decode steps: blocks grow at block boundaries, sequences admitted with their KV join decode, and more
running sequences than max_num_seqs take turns.

These cases pin the prefill-first policy (``chunked_prefill=False``); test_chunked_prefill.py covers the
chunked one."""

from __future__ import annotations

from pdserve.engine.scheduling.sequence import FinishReason, SequenceStatus
from tests.engine.scheduling._scheduler_sim import NEXT_TOKEN, ids, make_scheduler, make_seq, step


def test_decode_grows_blocks_at_block_boundaries() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    seq = make_seq("s", 3)
    sched.add(seq)
    step(sched)  # prefill: 4 positions allocated, one block
    assert seq.num_tokens == 4 and len(seq.block_table) == 1
    first_block = seq.block_table[0]
    for _ in range(10):
        n = seq.num_tokens  # this decode step writes KV for positions 0..n-1
        batch = step(sched)
        assert not batch.is_prefill and seq.block_table[0] == first_block
        assert len(seq.block_table) == sched.blocks.blocks_for(n)
    assert len(set(seq.block_table)) == len(seq.block_table) == sched.blocks.num_used == 4


def test_admit_running_joins_decode_without_a_prefill() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    seq = make_seq("kv", 6)
    seq.append_token(NEXT_TOKEN)  # first token sampled elsewhere
    sched.blocks.allocate(seq, seq.num_tokens)
    table = list(seq.block_table)
    sched.admit_running(seq)
    assert seq.status is SequenceStatus.RUNNING
    batch = step(sched)
    assert not batch.is_prefill and ids(batch.seqs) == ["kv"]
    assert seq.block_table == table  # 7 positions still fit in 2 blocks
    step(sched)
    assert seq.block_table[:2] == table and len(seq.block_table) == 2
    step(sched)  # 9 positions: a third block
    assert seq.block_table[:2] == table and len(seq.block_table) == 3


def test_more_running_than_max_num_seqs_take_turns_and_none_starves() -> None:
    """A decode worker admits every KV it is sent; with 3 running and 2 per step, steps go round
    robin, so no sequence waits for others to finish (it did: the 65th of 64 stalled for 35 s)."""
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"kv{i}", 3, max_tokens=50) for i in range(3)]
    for seq in seqs:
        seq.append_token(NEXT_TOKEN)
        sched.blocks.allocate(seq, seq.num_tokens)
        sched.admit_running(seq)
    turns = [ids(step(sched).seqs) for _ in range(3)]
    assert turns == [["kv0", "kv1"], ["kv2", "kv0"], ["kv1", "kv2"]]
    assert ids(sched.running) == ["kv0", "kv1", "kv2"]  # admission order is kept for preemption
    for _ in range(30):
        step(sched)
        outputs = [s.num_output_tokens for s in seqs]
        assert max(outputs) - min(outputs) <= 1
    sched.finish(seqs[0], FinishReason.ABORT)
    assert [len(step(sched).seqs) for _ in range(3)] == [2, 2, 2]  # all that remain fit one step again
