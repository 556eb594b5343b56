"""Block hashes for prefix caching and prefix-aware routing.

A full KV block of ``block_size`` tokens is named by a hash of its tokens chained to its parent
block's hash, so equal hashes mean equal whole prefixes up to and including the block (vLLM's
automatic prefix caching; the Mooncake trace's ``hash_ids`` name 512-token blocks the same way).
SHA-256 rather than Python's ``hash``: the same prompt gives the same names in every process (the
router's index, the decode worker's cache), and a collision is practically impossible. The
block manager still compares tokens before it reuses a block.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes  # 16 bytes


def hash_block(parent: BlockHash | None, tokens: tuple[int, ...] | list[int]) -> BlockHash:
    """The name of a block holding ``tokens`` whose prefix block is named ``parent`` (None: first block)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()[:16]


def prefix_hashes(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """Names of the full blocks of ``token_ids``, first block first."""
    out: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
