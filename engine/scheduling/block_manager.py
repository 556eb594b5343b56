"""Paged KV cache bookkeeping: which block ids belong to which sequence (plain Python over ints)."""

from __future__ import annotations

from collections import deque

from pdserve.engine.scheduling.sequence import Sequence


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` token slots each.

    A sequence of n KV positions holds ceil(n / block_size) blocks; slot of position p is
    ``block_table[p // block_size] * block_size + p % block_size`` (the slot mapping).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold ``num_positions`` KV positions."""
        return -(-num_positions // self.block_size)

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_for(num_positions) <= len(self._free)

    def allocate(self, seq: Sequence, num_positions: int) -> None:
        """Give ``seq`` enough blocks for ``num_positions`` positions.

        Raises RuntimeError when the sequence already holds blocks or too few are free (callers
        check ``can_allocate`` first).
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds {len(seq.block_table)} blocks")
        need = self.blocks_for(num_positions)
        if need > len(self._free):
            raise RuntimeError(f"{seq.request_id}: need {need} KV blocks, {len(self._free)} free")
        seq.block_table = [self._free.popleft() for _ in range(need)]

    def can_grow(self, seq: Sequence, num_positions: int) -> bool:
        """True when ``seq`` can hold ``num_positions`` positions after at most the free blocks."""
        return self.blocks_for(num_positions) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Append blocks so that ``seq`` holds ``num_positions`` positions (RuntimeError if short)."""
        need = self.blocks_for(num_positions) - len(seq.block_table)
        if need > len(self._free):
            raise RuntimeError(f"{seq.request_id}: need {need} more KV blocks, {len(self._free)} free")
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        """Return every block of ``seq`` (no-op when it holds none)."""
        self._free.extend(seq.block_table)
        seq.block_table = []
