"""Paged KV cache bookkeeping: which block ids belong to which sequence, and (with prefix caching)
which full blocks hold which tokens, so that a later request with the same prefix reuses them.

Plain Python over ints: the tensors live in the model runner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from pdserve.engine.scheduling.kv_groups import window_block_start
from pdserve.engine.scheduling.prefix_hash import BlockHash, hash_block
from pdserve.engine.scheduling.sequence import Sequence

NULL_BLOCK = -1  # a block-table entry whose block was freed: its positions fell out of the sliding window


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` token slots each.

    A sequence of n KV positions holds ceil(n / block_size) blocks; slot of position p is
    ``block_table[p // block_size] * block_size + p % block_size`` (the slot mapping).

    With ``enable_prefix_caching`` (vLLM's automatic prefix caching, SGLang's RadixAttention in
    block form), every full block that a step has written is keyed by a hash chained to its
    parent block's hash (``prefix_hash.hash_block``) and keeps its tokens for an equality check,
    so a hash collision can never hand a request someone else's KV. Blocks are reference counted:
    sequences with a common prefix share its blocks. A block nobody references keeps its content
    and stays reclaimable: allocation takes never-used blocks first, then evicts cached ones least
    recently freed first (a sequence's last block before its first, so prefixes outlive tails).

    With ``sliding_window`` (a model whose every layer attends to at most that many latest
    positions, ``ModelConfig.kv_window``), ``free_outside_window`` drops a sequence's blocks that
    no later query can read, as vLLM's sliding-window manager does: their table entries become
    ``NULL_BLOCK`` (the table keeps its length, so ``p // block_size`` still indexes it), a sequence
    holds about ``sliding_window / block_size + 1`` blocks however long it grows, and a hashed block
    stays cached for later prefixes.

    With ``group_windows`` (a hybrid model's ``KvGroups.windows``, see ``kv_groups``) a sequence
    holds one table per KV cache group (``Sequence.block_tables``), all drawn from this one pool:
    the groups with a window free their old blocks as above while the full-attention groups keep
    theirs. Counts of blocks (``num_free``, ``num_held``, the need of ``can_grow``) are over all
    groups; a cached prefix is one whose every block is cached in every group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        hash_fn: Callable[[BlockHash | None, tuple[int, ...]], BlockHash] = hash_block,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
    ) -> None:
        windows = (sliding_window,) if group_windows is None else tuple(group_windows)
        for w in windows:
            if w is not None and w < 1:
                raise ValueError(f"sliding_window must be >= 1, got {w}")
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        self.num_blocks = num_blocks
        self.group_windows = windows
        self.num_groups = len(windows)
        # the window of every layer's KV when all groups have one, else None (see ``window_start``)
        self.sliding_window = None if None in windows else max(windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self._free: deque[int] = deque(range(num_blocks))  # no content worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._block_key: list[tuple[int, BlockHash] | None] = [None] * num_blocks  # (group, hash)
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_key: dict[tuple[int, BlockHash], int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up (counted once per admission)
        self.num_prefix_hits = 0  # of those, tokens found cached
        self.num_window_freed = 0  # blocks freed because their positions left the sliding window

    # -- occupancy ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never used plus cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a reusable prefix (referenced or not)."""
        return len(self._by_key)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block tables, one per group (created empty on first use)."""
        tables = seq.block_tables
        while len(tables) < self.num_groups:
            tables.append([])
        return tables

    def num_held(self, seq: Sequence) -> int:
        """Blocks ``seq`` references, all groups (its tables less the entries freed outside the window)."""
        return sum(len(t) - t.count(NULL_BLOCK) for t in seq.block_tables)

    def blocks_for(self, num_positions: int) -> int:
        """Blocks one group's table needs to cover ``num_positions`` KV positions."""
        return -(-num_positions // self.block_size)

    def max_blocks_for(self, num_positions: int, step: int) -> int:
        """The most blocks a sequence growing to ``num_positions`` positions holds at once, all
        groups, when each step computes at most ``step`` positions (a window group frees behind it)."""
        full = self.blocks_for(num_positions)
        return sum(full if w is None else min(full, self.blocks_for(w + step) + 1) for w in self.group_windows)

    def can_allocate(self, num_positions: int) -> bool:
        return self.num_groups * self.blocks_for(num_positions) <= self.num_free

    # -- allocation -----------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._block_key[block]]
            self._block_key[block] = self._block_tokens[block] = None
        self._refs[block] = 1
        return block

    def allocate(self, seq: Sequence, num_positions: int) -> None:
        """Give ``seq`` enough blocks for ``num_positions`` positions.

        Raises RuntimeError when the sequence already holds blocks or too few are free (callers
        check ``can_allocate`` first).
        """
        if any(seq.block_tables):
            raise RuntimeError(f"{seq.request_id} already holds {self.num_held(seq)} blocks")
        self.grow(seq, num_positions)

    def num_to_grow(self, seq: Sequence, num_positions: int) -> int:
        """Blocks ``grow(seq, num_positions)`` would take, all groups."""
        want = self.blocks_for(num_positions)
        return sum(max(0, want - len(t)) for t in self._tables(seq))

    def can_grow(self, seq: Sequence, num_positions: int) -> bool:
        """True when ``seq`` can hold ``num_positions`` positions after at most the free blocks."""
        return self.num_to_grow(seq, num_positions) <= self.num_free

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Append blocks so that ``seq`` holds ``num_positions`` positions in every group
        (RuntimeError if short)."""
        need = self.num_to_grow(seq, num_positions)
        if need > self.num_free:
            raise RuntimeError(f"{seq.request_id}: need {need} more KV blocks, {self.num_free} free")
        want = self.blocks_for(num_positions)
        for table in self._tables(seq):
            while len(table) < want:
                table.append(self._take())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks (no-op when it holds none). A block left
        unreferenced stays cached when it holds a hashed prefix, else it is free."""
        for table in seq.block_tables:
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self._release(block)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.block_hashes = []

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._block_key[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def _window_start(self, window: int | None, next_position: int) -> int:
        return window_block_start(window, self.block_size, next_position)

    def window_start(self, next_position: int) -> int:
        """First position a query at ``next_position`` or later can read in any layer, rounded down
        to a block boundary: 0 unless every layer has a sliding window. A query at p sees keys
        p - window + 1 .. p (transformers' sliding-window rule)."""
        return self._window_start(self.sliding_window, next_position)

    def free_outside_window(self, seq: Sequence) -> int:
        """Free ``seq``'s blocks, in the groups with a window, that lie wholly before the window of
        its next query (at position ``num_computed_tokens``); returns how many (0 without a window)."""
        freed = 0
        for window, table in zip(self.group_windows, self._tables(seq)):
            if window is None:
                continue
            i = min(self._window_start(window, seq.num_computed_tokens) // self.block_size, len(table)) - 1
            while i >= 0 and table[i] != NULL_BLOCK:  # the freed entries are always a prefix of the table
                self._release(table[i])
                table[i] = NULL_BLOCK
                freed += 1
                i -= 1
        self.num_window_freed += freed
        return freed

    def group_window_start(self, group: int, next_position: int) -> int:
        """``window_start`` of one KV cache group: 0 for a full-attention group."""
        return self._window_start(self.group_windows[group], next_position)

    def skip_outside_window(self, seq: Sequence, next_position: int) -> int:
        """Make ``seq``'s tables in the groups with a window hold no block before the window of a
        query at ``next_position``: blocks held there are released, a table shorter than that is
        padded with ``NULL_BLOCK`` (a sequence placed from a KV hand-off, whose window layers need
        only the window). Returns the blocks released."""
        freed = 0
        for g, table in enumerate(self._tables(seq)):
            k = self.group_window_start(g, next_position) // self.block_size
            for i in range(min(k, len(table))):
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
                    table[i] = NULL_BLOCK
                    freed += 1
            table += [NULL_BLOCK] * (k - len(table))
        self.num_window_freed += freed
        return freed

    # -- prefix caching -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a waiting ``seq`` that holds no blocks; returns its
        length in tokens (a multiple of ``block_size``, 0 without prefix caching). A block counts
        when every group has it cached.

        The last token is never taken from the cache: its logits must be computed to sample."""
        if not self.enable_prefix_caching or any(seq.block_tables):
            return 0
        bs, tokens, tables = self.block_size, seq.token_ids, self._tables(seq)
        parent: BlockHash | None = None
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash_fn(parent, block_tokens)
            found = [self._by_key.get((g, h)) for g in range(self.num_groups)]
            # a miss, or a hash collision
            if any(block is None or self._block_tokens[block] != block_tokens for block in found):
                break
            for table, block in zip(tables, found):
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
                table.append(block)
            seq.block_hashes.append(h)
            parent = h
        cached = len(seq.block_hashes) * bs
        self.num_prefix_queries += len(tokens)
        self.num_prefix_hits += cached
        return cached

    def cache_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """Key every full block among ``seq``'s first ``num_computed`` positions (its KV written by a
        finished step) so that later requests can reuse it. A block whose content another block
        already holds stays private: the first writer owns the cache entry."""
        if not self.enable_prefix_caching:
            return
        bs, tokens, tables = self.block_size, seq.token_ids, self._tables(seq)
        for i in range(len(seq.block_hashes), num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash_fn(parent, block_tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(tables):
                block = table[i]
                if block != NULL_BLOCK and (g, h) not in self._by_key and self._block_key[block] is None:
                    self._by_key[g, h] = block
                    self._block_key[block] = (g, h)
                    self._block_tokens[block] = block_tokens

    def reset_prefix_stats(self) -> None:
        self.num_prefix_queries = self.num_prefix_hits = 0
