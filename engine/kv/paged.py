"""One layer's KV in and out of the paged cache, for the layer-wise hand-off.

A layer's part of the cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 on
dim 0 is K, 1 is V); a sequence's position ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``. Both functions move positions ``start .. end - 1`` (any, not only whole blocks)
with one slice copy per run of consecutive block ids.
"""

from __future__ import annotations

import torch


def layer_runs(table: list[int], start: int, end: int, block_size: int) -> list[tuple[int, int, int, int]]:
    """Positions ``start .. end - 1`` as runs over consecutive block ids: ``(p0, p1, block, offset)``
    where positions ``p0 .. p1 - 1`` are the flattened slots ``offset ..`` of the blocks from ``block``.
    ValueError when ``table`` is too short or a block of the range was freed (a negative id)."""
    if not 0 <= start < end:
        raise ValueError(f"empty or negative position range {start}..{end}")
    first, last = start // block_size, (end - 1) // block_size
    if len(table) <= last:
        raise ValueError(f"positions up to {end - 1} need {last + 1} blocks; the table has {len(table)}")
    if min(table[first : last + 1]) < 0:
        raise ValueError(f"positions {start}..{end - 1} include blocks freed outside the sliding window")
    runs, i = [], first
    while i <= last:
        j = i + 1
        while j <= last and table[j] == table[j - 1] + 1:
            j += 1
        p0, p1 = max(start, i * block_size), min(end, j * block_size)
        runs.append((p0, p1, table[i], p0 - i * block_size))
        i = j
    return runs


def _slots(cache: torch.Tensor, block: int, offset: int, count: int) -> torch.Tensor:
    blocks = -(-(offset + count) // cache.shape[2])
    return cache[:, block : block + blocks].flatten(1, 2)[:, offset : offset + count]


def read_layer(
    cache: torch.Tensor, table: list[int], start: int, end: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy positions ``start .. end - 1`` of one layer's ``cache`` into ``out`` (default: a new
    tensor on the cache's device): [2, end - start, num_kv_heads, head_dim]."""
    if out is None:
        out = torch.empty((2, end - start, *cache.shape[3:]), dtype=cache.dtype, device=cache.device)
    for p0, p1, block, offset in layer_runs(table, start, end, cache.shape[2]):
        out[:, p0 - start : p1 - start].copy_(_slots(cache, block, offset, p1 - p0))
    return out


def write_layer(cache: torch.Tensor, table: list[int], start: int, kv: torch.Tensor) -> None:
    """Write ``kv`` [2, tokens, num_kv_heads, head_dim] into positions ``start ..`` of one layer's ``cache``."""
    for p0, p1, block, offset in layer_runs(table, start, start + kv.shape[1], cache.shape[2]):
        _slots(cache, block, offset, p1 - p0).copy_(kv[:, p0 - start : p1 - start])
