"""Bounded waiting in the scheduler: prompts are admitted past max_num_seqs while KV blocks
allow, running sequences take turns, and a prompt kept out by a full KV cache preempts the
sequence holding the most blocks."""

from __future__ import annotations

import pytest

from pdserve.engine.scheduling.sequence import SequenceStatus
from tests.engine.scheduling._scheduler_sim import NEXT_TOKEN, ids, make_scheduler, make_seq, step


def test_prefill_admits_past_max_num_seqs_and_running_take_turns() -> None:
    """A step holds at most max_num_seqs prompts, but a full running batch does not keep prompts
    waiting: they are admitted (KV permitting) and the running sequences take turns."""
    sched = make_scheduler(max_num_seqs=3)
    for i in range(5):
        sched.add(make_seq(f"r{i}", 2, max_tokens=3))
    batch = step(sched)
    assert batch.is_prefill and ids(batch.seqs) == ["r0", "r1", "r2"]
    batch = step(sched)
    assert batch.is_prefill and ids(batch.seqs) == ["r3", "r4"]
    assert len(sched.running) == 5 and not sched.waiting
    assert ids(step(sched).seqs) == ["r0", "r1", "r2"]
    assert ids(step(sched).seqs) == ["r3", "r4", "r0"]
    while sched.has_work():
        assert len(step(sched).seqs) <= 3
    assert sched.blocks.num_used == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_beside_more_admitted_kv_than_max_num_seqs_samples_at_once(chunked: bool) -> None:
    """Split placement's decode worker: 12 sequences arrived with their KV (admit_running) on a
    worker that steps 4 at a time, then a prompt it prefills itself (conditional disaggregation,
    or a preempted sequence to recompute). It is not held until one of the 12 ends: it samples
    its first token within 2 steps."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill=chunked)
    for i in range(12):
        seq = make_seq(f"kv{i}", 3, max_tokens=500)
        seq.append_token(NEXT_TOKEN)
        sched.blocks.allocate(seq, seq.num_tokens)
        sched.admit_running(seq)
    step(sched)
    short = make_seq("short", 10, max_tokens=3)
    sched.add(short)
    steps = 0
    while not short.num_output_tokens:
        step(sched)
        steps += 1
    assert steps <= 2
    while short.status is not SequenceStatus.FINISHED:
        assert len(step(sched).seqs) <= 4
        steps += 1
    assert steps <= 2 + 2 * -(-13 // 4)  # its later tokens come in turns with the 12


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_kept_out_by_a_full_kv_cache_preempts_the_largest_sequence(chunked: bool) -> None:
    """The KV cache is full of running sequences; a new prompt waits at most PREEMPT_AFTER_STEPS
    steps, then the sequence holding the most blocks is preempted for it (and is recomputed
    later, second in line), so the new prompt's first token does not wait for anyone to finish."""
    from pdserve.engine.scheduling.scheduler import PREEMPT_AFTER_STEPS

    sched = make_scheduler(
        num_blocks=6, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, chunked_prefill=chunked
    )
    big, small = make_seq("big", 40, max_tokens=50), make_seq("small", 20, max_tokens=60)
    sched.add(big)
    sched.add(small)
    step(sched)  # big holds 3 blocks, small 2: one is free
    new = make_seq("new", 20, max_tokens=2)  # needs 2
    sched.add(new)
    steps = 0
    while not new.num_output_tokens:
        step(sched)
        steps += 1
        assert steps <= PREEMPT_AFTER_STEPS + 2
    assert big.num_preemptions == 1 and small.num_preemptions == 0
    assert ids(sched.waiting)[0] == "big"
    while sched.has_work():
        step(sched)
    assert (big.num_output_tokens, small.num_output_tokens, new.num_output_tokens) == (50, 60, 2)
    assert sched.blocks.num_used == 0
