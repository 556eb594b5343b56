"""Sliding-window block freeing in BlockManager and the scheduler: blocks wholly before the window
of a sequence's next query are freed, their table entries become NULL_BLOCK, hashed ones stay
cached, and a sequence holds about window / block_size + 1 blocks however long it grows."""

from __future__ import annotations

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import NULL_BLOCK, BlockManager
from pdserve.engine.scheduling.scheduler import Scheduler
from pdserve.engine.scheduling.sequence import Sequence


def _seq(n: int, rid: str = "r0", max_tokens: int = 8) -> Sequence:
    return Sequence.new(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize(("next_pos", "start"), [(0, 0), (9, 0), (12, 0), (13, 4), (16, 4), (17, 8), (40, 28)])
def test_window_start_is_the_first_readable_block_boundary(next_pos, start):
    # window 10, blocks of 4: a query at p reads p - 9 .. p
    assert BlockManager(16, 4, sliding_window=10).window_start(next_pos) == start


def test_no_window_frees_nothing():
    bm = BlockManager(16, 4)
    seq = _seq(30)
    bm.allocate(seq, 30)
    seq.num_computed_tokens = 30
    assert bm.free_outside_window(seq) == 0 and NULL_BLOCK not in seq.block_table
    assert bm.window_start(1000) == 0


def test_blocks_before_the_window_are_freed_once_and_free_skips_them():
    bm = BlockManager(16, 4, sliding_window=10)
    seq = _seq(30)
    bm.allocate(seq, 30)  # 8 blocks
    table = list(seq.block_table)
    seq.num_computed_tokens = 30  # next query at 30 reads 21..30: blocks 0..4 (positions 0..19) are out
    assert bm.free_outside_window(seq) == 5
    assert seq.block_table == [NULL_BLOCK] * 5 + table[5:]
    assert (bm.num_used, bm.num_held(seq), bm.num_window_freed) == (3, 3, 5)
    assert bm.free_outside_window(seq) == 0  # nothing more until the window moves
    seq.num_computed_tokens = 33
    assert bm.free_outside_window(seq) == 1 and seq.block_table[5] == NULL_BLOCK
    bm.free(seq)
    assert (bm.num_used, bm.num_free) == (0, 16)


def test_a_freed_hashed_block_stays_cached_for_a_later_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True, sliding_window=6)
    first = _seq(21)
    bm.allocate(first, 21)
    first.num_computed_tokens = 21
    bm.cache_full_blocks(first, 21)
    bm.free_outside_window(first)  # window reads 16..21: blocks 0..3 freed, kept as cached
    assert first.block_table[:4] == [NULL_BLOCK] * 4
    second = _seq(21, "r1")
    assert bm.match_prefix(second) == 20  # its whole prefix is still found, freed blocks included
    bm.free(second)
    bm.free(first)
    assert bm.num_used == 0


def test_chunked_prefill_and_decode_hold_a_bounded_number_of_blocks():
    """A 200-token prompt in 16-token chunks and 60 decode steps never hold more than
    ceil((window + chunk) / block_size) + 1 blocks, and every block comes back at the end."""
    bs, window, chunk = 4, 12, 16
    bm = BlockManager(64, bs, sliding_window=window)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=chunk)
    seq = _seq(200, max_tokens=60)
    sched.add(seq)
    peak = 0
    while sched.has_work():
        batch = sched.schedule()
        peak = max(peak, bm.num_used)
        sched.complete(batch, [7] * sum(batch.samples(i) for i in range(len(batch.seqs))))
        if not seq.is_finished:
            assert all(b == NULL_BLOCK for b in seq.block_table[: bm.window_start(seq.num_computed_tokens) // bs])
    assert seq.num_output_tokens == 60
    assert peak <= -(-(window + chunk) // bs) + 1
    assert bm.num_used == 0 and bm.num_window_freed >= (200 + 60 - window) // bs - 1


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        BlockManager(4, 4, sliding_window=0)
