"""Paged KV cache bookkeeping: which block ids belong to which sequence, and (with prefix caching)
which full blocks hold which tokens, so that a later request with the same prefix reuses them.

Plain Python over ints: the tensors live in the model runner.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

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
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        hash_fn: Callable[[BlockHash | None, tuple[int, ...]], BlockHash] = hash_block,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self._free: deque[int] = deque(range(num_blocks))  # no content worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
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
        return len(self._by_hash)

    def num_held(self, seq: Sequence) -> int:
        """Blocks ``seq`` references (its table less the entries freed outside the window)."""
        return len(seq.block_table) - seq.block_table.count(NULL_BLOCK)

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold ``num_positions`` KV positions."""
        return -(-num_positions // self.block_size)

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_for(num_positions) <= self.num_free

    # -- allocation -----------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._block_hash[block]]
            self._block_hash[block] = self._block_tokens[block] = None
        self._refs[block] = 1
        return block

    def allocate(self, seq: Sequence, num_positions: int) -> None:
        """Give ``seq`` enough blocks for ``num_positions`` positions.

        Raises RuntimeError when the sequence already holds blocks or too few are free (callers
        check ``can_allocate`` first).
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds {len(seq.block_table)} blocks")
        self.grow(seq, num_positions)

    def can_grow(self, seq: Sequence, num_positions: int) -> bool:
        """True when ``seq`` can hold ``num_positions`` positions after at most the free blocks."""
        return self.blocks_for(num_positions) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Append blocks so that ``seq`` holds ``num_positions`` positions (RuntimeError if short)."""
        need = self.blocks_for(num_positions) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError(f"{seq.request_id}: need {need} more KV blocks, {self.num_free} free")
        for _ in range(need):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks (no-op when it holds none). A block left
        unreferenced stays cached when it holds a hashed prefix, else it is free."""
        for block in reversed(seq.block_table):
            if block != NULL_BLOCK:
                self._release(block)
        seq.block_table = []
        seq.block_hashes = []

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._block_hash[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def window_start(self, next_position: int) -> int:
        """First position a query at ``next_position`` or later can read, rounded down to a block
        boundary: 0 without a sliding window. A query at p sees keys p - window + 1 .. p
        (transformers' sliding-window rule)."""
        if self.sliding_window is None:
            return 0
        return max(0, next_position - self.sliding_window + 1) // self.block_size * self.block_size

    def free_outside_window(self, seq: Sequence) -> int:
        """Free ``seq``'s blocks that lie wholly before the window of its next query (at position
        ``num_computed_tokens``); returns how many (0 without a sliding window)."""
        table, freed = seq.block_table, 0
        i = min(self.window_start(seq.num_computed_tokens) // self.block_size, len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:  # the freed entries are always a prefix of the table
            self._release(table[i])
            table[i] = NULL_BLOCK
            freed += 1
            i -= 1
        self.num_window_freed += freed
        return freed

    # -- prefix caching -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a waiting ``seq`` that holds no blocks; returns its
        length in tokens (a multiple of ``block_size``, 0 without prefix caching).

        The last token is never taken from the cache: its logits must be computed to sample."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        parent: BlockHash | None = None
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash_fn(parent, block_tokens)
            block = self._by_hash.get(h)
            if block is None or self._block_tokens[block] != block_tokens:  # miss, or a hash collision
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        cached = len(seq.block_table) * bs
        self.num_prefix_queries += len(tokens)
        self.num_prefix_hits += cached
        return cached

    def cache_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """Key every full block among ``seq``'s first ``num_computed`` positions (its KV written by a
        finished step) so that later requests can reuse it. A block whose content another block
        already holds stays private: the first writer owns the cache entry."""
        if not self.enable_prefix_caching:
            return
        bs, tokens = self.block_size, seq.token_ids
        for i in range(len(seq.block_hashes), num_computed // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash_fn(parent, block_tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self._by_hash and self._block_hash[block] is None:
                self._by_hash[h] = block
                self._block_hash[block] = h
                self._block_tokens[block] = block_tokens

    def reset_prefix_stats(self) -> None:
        self.num_prefix_queries = self.num_prefix_hits = 0
