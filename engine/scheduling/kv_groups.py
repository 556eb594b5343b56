"""KV cache groups: which layers share a block table.

A model whose layers all attend alike (all full attention, or all one sliding window) has one group.
A hybrid model (Gemma 2 and 3: sliding-window layers beside global ones) has several, so that the
sliding-window layers can free the blocks that fell out of their window while the global layers keep
every block. As in vLLM's hybrid KV cache manager, the groups are of equal size ``group_size``: the
layers of each attention kind are cut, in layer order, into groups of that many layers (the greatest
common divisor of the kinds' layer counts). Every group draws its blocks from one shared pool whose
blocks hold ``group_size`` layers: slot j of a block serves the j-th layer of whichever group holds
it. A sequence then holds ceil(n / block_size) blocks in each global group but only about
``window / block_size + 1`` in each sliding-window group, and no memory is split ahead of time
between the kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KvGroups:
    """``windows[g]``: group g's sliding window in positions (None: full attention);
    ``layers[g]``: its layers in order; ``group_of[i]`` / ``slot_of[i]``: layer i's group and its
    index inside the group (the block slot its K and V live in)."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group, the layers one KV block holds."""
        return len(self.layers[0])

    @cached_property
    def group_of(self) -> list[int]:
        out = [0] * sum(len(ls) for ls in self.layers)
        for g, ls in enumerate(self.layers):
            for i in ls:
                out[i] = g
        return out

    @cached_property
    def slot_of(self) -> list[int]:
        out = [0] * sum(len(ls) for ls in self.layers)
        for ls in self.layers:
            for j, i in enumerate(ls):
                out[i] = j
        return out


def window_block_start(window: int | None, block_size: int, next_position: int) -> int:
    """First position a query at ``next_position`` or later reads under a sliding ``window`` (it sees
    keys p - window + 1 .. p, transformers' rule), rounded down to a block boundary; 0 for None."""
    if window is None:
        return 0
    return max(0, next_position - window + 1) // block_size * block_size


def kv_groups(layer_windows: tuple[int | None, ...] | list[int | None], num_layers: int) -> KvGroups:
    """Group ``num_layers`` layers by their sliding window (``layer_windows[i]``, None: full
    attention; empty: every layer full). Full-attention groups come first. ValueError when
    ``layer_windows`` is neither empty nor one entry per layer."""
    windows = list(layer_windows) or [None] * num_layers
    if len(windows) != num_layers or num_layers < 1:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    size = math.gcd(*(len(ls) for ls in by_kind.values()))
    groups = [(w, tuple(ls[k : k + size])) for w, ls in by_kind.items() for k in range(0, len(ls), size)]
    return KvGroups(tuple(w for w, _ in groups), tuple(ls for _, ls in groups))
