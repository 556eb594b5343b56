"""Finishing and finding sequences, and a random workload (both policies) that finishes every request and
frees every block."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.scheduling.sequence import FinishReason, Sequence
from tests.engine.scheduling._scheduler_sim import NEXT_TOKEN, ids, make_scheduler, make_seq, step


def test_finish_frees_blocks_and_is_idempotent() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_seq("a", 5), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    step(sched)
    used = sched.blocks.num_used
    sched.finish(a, FinishReason.ABORT)
    assert a.is_finished and a.finish_reason is FinishReason.ABORT
    assert a.block_table == [] and sched.blocks.num_used == used - 2
    assert ids(sched.running) == ["b"]
    sched.finish(a, FinishReason.ERROR)
    assert a.finish_reason is FinishReason.ABORT, "the first finish reason wins"
    assert sched.blocks.num_used == used - 2
    assert ids(sched.running) == ["b"]


def test_finish_without_reason_keeps_the_sequence_reason() -> None:
    sched = make_scheduler()
    seq = make_seq("s", 2, max_tokens=1)
    sched.add(seq)
    sched.schedule()
    seq.append_token(NEXT_TOKEN)
    assert seq.finish_reason is FinishReason.LENGTH
    sched.finish(seq)
    assert seq.finish_reason is FinishReason.LENGTH
    assert not sched.has_work() and sched.blocks.num_used == 0


def test_finish_removes_a_waiting_sequence() -> None:
    sched = make_scheduler()
    assert not sched.has_work() and sched.schedule() is None
    seq = make_seq("w", 3)
    sched.add(seq)
    assert sched.has_work()
    sched.finish(seq, FinishReason.ABORT)
    assert not sched.waiting and not sched.has_work()
    assert sched.schedule() is None


def test_find_looks_in_both_queues() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a", 2), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.find("a") is a and a in sched.running
    assert sched.find("b") is b and b in sched.waiting
    assert sched.find("zzz") is None
    sched.finish(a, FinishReason.ABORT)
    assert sched.find("a") is None


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_finishes_everything_and_frees_every_block(seed: int, chunked: bool) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.randint(6, 20)
    sched = make_scheduler(
        num_blocks,
        bs,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(4, 32),
        chunked_prefill=chunked,
    )
    expected: dict[str, int] = {}
    everything: list[Sequence] = []
    for i in range(rng.randint(5, 15)):
        prompt, max_tokens = rng.randint(1, 12), rng.randint(1, 12)
        if sched.blocks.blocks_for(prompt + max_tokens) > num_blocks:
            continue  # the engine refuses such requests before they reach the scheduler
        seq = make_seq(f"r{i}", prompt, max_tokens)
        sched.add(seq)
        everything.append(seq)
        expected[seq.request_id] = max_tokens
    for _ in range(2000):
        if not sched.has_work():
            break
        batch = step(sched)
        assert batch is not None, "work is left but nothing can be scheduled"
        live = [s for s in everything if s.block_table]
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)) == sched.blocks.num_used
        assert all(not s.block_table for s in sched.waiting)
        assert len(batch.seqs) <= sched.max_num_seqs
        if chunked:
            assert sum(batch.num_query_tokens) <= sched.max_num_batched_tokens
    assert not sched.has_work()
    assert sched.blocks.num_used == 0
    assert {s.request_id: s.num_output_tokens for s in everything} == expected
