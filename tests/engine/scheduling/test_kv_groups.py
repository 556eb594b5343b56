"""KV cache groups (engine/scheduling/kv_groups.py) and the block manager serving several of them:
a hybrid model's sliding-window groups free the blocks behind their window while its
full-attention group keeps every block, all from one pool."""

from __future__ import annotations

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import NULL_BLOCK, BlockManager
from pdserve.engine.scheduling.kv_groups import kv_groups
from pdserve.engine.scheduling.sequence import Sequence


def test_gemma3_layers_form_equal_groups_over_one_pool():
    """Gemma 3 270M: 18 layers, every sixth global; 3 global and 15 sliding-window layers make
    six groups of three, and each block slot serves one layer of every group."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    g = kv_groups(windows, 18)
    assert g.windows == (None, 512, 512, 512, 512, 512) and g.group_size == 3
    assert g.layers[0] == (5, 11, 17) and g.layers[1] == (0, 1, 2)
    assert [g.group_of[i] for i in (0, 5, 6, 17)] == [1, 0, 2, 0]
    for layers in g.layers:  # each slot once per group
        assert sorted(g.slot_of[i] for i in layers) == [0, 1, 2]


@pytest.mark.parametrize(
    "windows, groups, size",
    [([], (None,), 4), ([8] * 4, (8,), 4), ([8, None, 8], (None, 8, 8), 1), ([None, None, 8, 8], (None, 8), 2)],
)
def test_uniform_models_have_one_group_and_hybrid_ones_several(windows, groups, size):
    g = kv_groups(windows, len(windows) or 4)
    assert g.windows == groups and g.group_size == size
    assert sorted(i for layers in g.layers for i in layers) == list(range(len(windows) or 4))


def test_a_window_per_layer_must_match_the_layers():
    with pytest.raises(ValueError, match="3 layer windows for 4 layers"):
        kv_groups([None, 8, 8], 4)


def _seq(rid: str, n: int) -> Sequence:
    return Sequence.new(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_the_window_group_frees_behind_its_window_and_the_full_group_keeps_all():
    bm = BlockManager(64, 4, group_windows=(None, 8))
    seq = _seq("a", 40)
    assert bm.num_to_grow(seq, 40) == 20
    bm.grow(seq, 40)
    assert [len(t) for t in seq.block_tables] == [10, 10] and bm.num_used == 20
    seq.num_computed_tokens = 40
    # the next query (position 40) reads 33..40: block 8 on; blocks 0..7 of the window group go
    assert bm.free_outside_window(seq) == 8
    assert NULL_BLOCK not in seq.block_tables[0]
    assert seq.block_tables[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in seq.block_tables[1][8:]
    assert bm.num_held(seq) == 12 and bm.num_used == 12
    assert bm.window_start(40) == 0  # the full-attention layers still read from position 0
    assert bm.max_blocks_for(40, step=4) == 10 + 4  # full group: 10; window group: (8 + 4) / 4 + 1
    bm.grow(seq, 41)  # a decode step into a new block takes one in each group
    assert [len(t) for t in seq.block_tables] == [11, 11] and bm.num_used == 14
    bm.free(seq)
    assert bm.num_used == 0 and seq.block_tables == [[], []]


def test_a_cached_prefix_needs_its_blocks_in_every_group():
    bm = BlockManager(64, 4, enable_prefix_caching=True, group_windows=(None, 8))
    a = _seq("a", 17)
    bm.grow(a, 17)
    bm.cache_full_blocks(a, 16)
    assert bm.num_cached == 8  # four full blocks in each group
    window_blocks = list(a.block_tables[1])
    bm.free(a)
    b = _seq("b", 17)
    assert bm.match_prefix(b) == 16 and b.block_tables[1] == window_blocks[:4]
    bm.free(b)
    # evict the window group's third block: the prefix now ends before it in every group
    while bm._free:
        bm._take()
    bm._evictable.move_to_end(window_blocks[2], last=False)
    bm._take()
    c = _seq("c", 17)
    assert bm.match_prefix(c) == 8 and [len(t) for t in c.block_tables] == [2, 2]
