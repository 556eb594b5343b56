"""Scheduler with real Sequence and BlockManager objects; model steps are simulated by appending tokens.

Most cases here pin the prefill-first policy (``chunked_prefill=False``); test_chunked_prefill.py
covers the chunked one, and the random workload runs both."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.scheduler import Batch, Scheduler
from pdserve.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus

NEXT_TOKEN = 7


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence.new(request_id, list(range(1, prompt_len + 1)), params)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunked_prefill: bool = False,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, chunked_prefill)


def step(sched: Scheduler) -> Batch | None:
    """One simulated model step: every sequence that samples gets one token; finished ones leave."""
    batch = sched.schedule()
    if batch is not None:
        sched.complete(batch, [NEXT_TOKEN] * sum(batch.samples(i) for i in range(len(batch.seqs))))
    return batch


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


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
