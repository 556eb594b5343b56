"""BlockManager: block accounting, slot arithmetic, refusals and free idempotence."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.sequence import Sequence


def make_seq(request_id: str = "r0") -> Sequence:
    return Sequence.new(request_id, [1, 2, 3], SamplingParams())


def slot(seq: Sequence, position: int, block_size: int) -> int:
    """The slot mapping documented in BlockManager."""
    return seq.block_table[position // block_size] * block_size + position % block_size


def assert_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    """Live tables are disjoint, in range, and together with the free count cover every block."""
    owned = [b for s in live for b in s.block_table]
    assert len(owned) == len(set(owned)), f"a block id is owned twice: {sorted(owned)}"
    assert all(0 <= b < bm.num_blocks for b in owned)
    assert bm.num_used == len(owned)
    assert bm.num_free + bm.num_used == bm.num_blocks


def test_fresh_manager_has_every_block_free() -> None:
    bm = BlockManager(num_blocks=7, block_size=4)
    assert (bm.num_free, bm.num_used) == (7, 0)


@pytest.mark.parametrize(
    ("positions", "block_size", "blocks"),
    [
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 1),
        (4, 4, 1),
        (5, 4, 2),
        (8, 4, 2),
        (9, 4, 3),
        (1, 1, 1),
        (7, 1, 7),
        (16, 16, 1),
        (17, 16, 2),
        (100, 16, 7),
    ],
)
def test_blocks_for_is_ceiling_division(positions: int, block_size: int, blocks: int) -> None:
    assert BlockManager(num_blocks=1, block_size=block_size).blocks_for(positions) == blocks


def test_allocate_takes_exactly_the_blocks_needed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert (bm.num_free, bm.num_used) == (7, 3)


def test_slot_mapping_is_unique_and_in_range_across_sequences() -> None:
    bs = 4
    bm = BlockManager(num_blocks=12, block_size=bs)
    lengths = {"a": 5, "b": 1, "c": 12, "d": 8}
    seqs = {rid: make_seq(rid) for rid in lengths}
    for rid, n in lengths.items():
        bm.allocate(seqs[rid], n)
    bm.grow(seqs["b"], 6)
    lengths["b"] = 6
    slots = [slot(seqs[rid], p, bs) for rid, n in lengths.items() for p in range(n)]
    assert len(slots) == len(set(slots)), "two KV positions map to the same slot"
    assert all(0 <= s < bm.num_blocks * bs for s in slots)
    # consecutive positions inside a block are consecutive slots
    a = seqs["a"]
    assert [slot(a, p, bs) for p in range(4)] == list(range(a.block_table[0] * bs, a.block_table[0] * bs + 4))


def test_can_allocate_boundary() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.can_allocate(12)
    assert not bm.can_allocate(13)
    bm.allocate(make_seq("x"), 5)  # two blocks
    assert bm.can_allocate(4)
    assert not bm.can_allocate(5)


def test_over_allocation_raises_and_takes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq()
    with pytest.raises(RuntimeError, match="need 4 more KV blocks, 3 free"):
        bm.allocate(seq, 13)
    assert seq.block_table == []
    assert bm.num_free == 3


def test_allocate_twice_raises_and_keeps_the_first_table() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("twice")
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    with pytest.raises(RuntimeError, match="twice already holds 1 blocks"):
        bm.allocate(seq, 4)
    assert seq.block_table == table
    assert bm.num_used == 1


def test_grow_adds_blocks_only_at_block_boundaries() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 3)
    first = list(seq.block_table)
    sizes = []
    for n in range(3, 14):
        bm.grow(seq, n)
        sizes.append(len(seq.block_table))
        assert seq.block_table[: len(first)] == first, "grow must keep the existing blocks in place"
    assert sizes == [bm.blocks_for(n) for n in range(3, 14)] == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert bm.num_used == 4
    assert len(set(seq.block_table)) == 4


def test_grow_to_fewer_positions_is_a_no_op() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 9)
    table = list(seq.block_table)
    bm.grow(seq, 2)
    assert seq.block_table == table
    assert bm.num_used == 3


def test_grow_beyond_free_raises_and_leaves_the_table() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 8)
    bm.allocate(b, 1)
    assert bm.can_grow(b, 4)
    assert not bm.can_grow(b, 5)
    table = list(b.block_table)
    with pytest.raises(RuntimeError, match="b: need 1 more KV blocks, 0 free"):
        bm.grow(b, 5)
    assert b.block_table == table
    assert bm.num_free == 0


def test_can_grow_counts_blocks_already_held() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq()
    bm.allocate(seq, 8)  # 2 held, 2 free
    assert bm.can_grow(seq, 16)  # needs 4 in all: 2 more
    assert not bm.can_grow(seq, 17)


def test_free_returns_blocks_and_is_idempotent() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 5)  # 3 blocks
    bm.allocate(b, 3)  # 2 blocks
    bm.free(a)
    assert a.block_table == []
    assert (bm.num_free, bm.num_used) == (3, 2)
    bm.free(a)
    assert (bm.num_free, bm.num_used) == (3, 2), "a second free must not return blocks again"
    # the freed blocks are really available, and none is handed out twice
    c = make_seq("c")
    bm.allocate(c, 6)
    assert set(c.block_table).isdisjoint(b.block_table)
    assert bm.num_free == 0
    assert not bm.can_allocate(1)


def test_free_of_a_sequence_without_blocks_is_a_no_op() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.free(make_seq())
    assert (bm.num_free, bm.num_used) == (2, 0)


def test_allocate_zero_positions_takes_no_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = make_seq()
    bm.allocate(seq, 0)
    assert seq.block_table == []
    assert bm.num_free == 2


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_never_hand_out_a_block_twice(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    bm = BlockManager(num_blocks=rng.randint(1, 24), block_size=bs)
    positions: dict[str, int] = {}
    seqs: dict[str, Sequence] = {}
    freed: list[Sequence] = []
    for i in range(300):
        op = rng.random()
        if op < 0.35:
            seq, n = make_seq(f"s{i}"), rng.randint(0, 3 * bs + 2)
            if bm.can_allocate(n):
                bm.allocate(seq, n)
                assert len(seq.block_table) == bm.blocks_for(n)
                if seq.block_table:
                    seqs[seq.request_id], positions[seq.request_id] = seq, n
            else:
                free_before = bm.num_free
                with pytest.raises(RuntimeError):
                    bm.allocate(seq, n)
                assert seq.block_table == [] and bm.num_free == free_before
        elif op < 0.7 and seqs:
            rid = rng.choice(sorted(seqs))
            seq, n = seqs[rid], positions[rid] + rng.randint(0, 2 * bs)
            before = list(seq.block_table)
            others = {b for r, s in seqs.items() if r != rid for b in s.block_table}
            if bm.can_grow(seq, n):
                bm.grow(seq, n)
                positions[rid] = n
                assert len(seq.block_table) == bm.blocks_for(n)
                assert seq.block_table[: len(before)] == before
                assert others.isdisjoint(seq.block_table[len(before) :])
            else:
                with pytest.raises(RuntimeError):
                    bm.grow(seq, n)
                assert seq.block_table == before
        elif op < 0.9 and seqs:
            rid = rng.choice(sorted(seqs))
            seq = seqs.pop(rid)
            del positions[rid]
            bm.free(seq)
            freed.append(seq)
        elif freed:
            bm.free(rng.choice(freed))  # double free: must change nothing
        assert_consistent(bm, list(seqs.values()))
    for seq in seqs.values():
        bm.free(seq)
    assert (bm.num_free, bm.num_used) == (bm.num_blocks, 0)
