"""The points ``pdserve profile`` measures, and how they are cut to what one engine can hold.

The default grid spans what a placement decision needs: prompt steps of
16..2048 tokens, cached prefixes of 256 and 1024 tokens, steps of 4 and 16 prompts at once, decode
batches of 1..64 sequences at contexts up to 4096 tokens, mixed steps at two decode contexts, and
hand-offs of 16..4096 tokens of KV; ``pdserve profile --time-budget`` cuts its largest values where a
slow machine would take longer than the budget (planner/budget.py). The quick grid is a few small
points of each kind, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Grid fields a user may set (``--prefill-tokens`` and so on); the others follow from these.
USER_FIELDS = ("prefill_tokens", "cached_tokens", "batch_sizes", "context_lens")


@dataclass(frozen=True)
class Grid:
    """Token counts are tokens, batch sizes sequences. ``cached_tokens``: cached prefixes (each
    measured under prompt steps of ``cached_with`` tokens); ``batched_*``: steps of several prompts
    (``batched_prompts`` of them, ``batched_tokens`` tokens each); ``mixed_*``: prompt chunks beside
    decoding sequences of ``mixed_contexts`` tokens each; ``repeats``: timed runs per point, spread
    over ``passes`` passes over a section's points, each pass of a point after ``warmup`` untimed
    runs."""

    prefill_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    cached_with: tuple[int, ...]
    batched_prompts: tuple[int, ...]
    batched_tokens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    mixed_prompt_tokens: tuple[int, ...]
    mixed_batch_sizes: tuple[int, ...]
    mixed_contexts: tuple[int, ...]
    handoff_tokens: tuple[int, ...]
    repeats: int
    warmup: int = 1
    passes: int = 3

    def pass_repeats(self) -> list[int]:
        """Timed runs of a point in each pass: ``repeats`` split as evenly as they go over at most
        ``passes`` passes (5 over 3: 2, 2, 1)."""
        k = min(self.passes, self.repeats)
        return [self.repeats // k + (i < self.repeats % k) for i in range(k)]

    @property
    def decode_margin(self) -> int:
        """Tokens a measured decoding sequence may still produce: one per step, plus its first
        token and one to spare, so it never finishes while it is measured."""
        return self.warmup + self.repeats + 2


DEFAULT = Grid(
    prefill_tokens=(16, 32, 64, 128, 256, 512, 1024, 2048),
    cached_tokens=(256, 1024),
    cached_with=(16, 128, 512),
    batched_prompts=(4, 16),
    batched_tokens=(16, 64, 128),
    batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    context_lens=(64, 256, 1024, 4096),
    mixed_prompt_tokens=(16, 128, 512),
    mixed_batch_sizes=(1, 8, 32),
    mixed_contexts=(256, 1024),
    handoff_tokens=(16, 64, 256, 1024, 4096),
    repeats=5,
)
QUICK = Grid(
    prefill_tokens=(16, 64, 256),
    cached_tokens=(64,),
    cached_with=(16, 64),
    batched_prompts=(4,),
    batched_tokens=(16,),
    batch_sizes=(1, 4),
    context_lens=(32, 128),
    mixed_prompt_tokens=(32, 128),
    mixed_batch_sizes=(2,),
    mixed_contexts=(32, 128),
    handoff_tokens=(16, 64, 256),
    repeats=3,
)


@dataclass(frozen=True)
class Limits:
    """What one engine holds: ``budget`` tokens a step, ``rows`` sequences a step, ``room`` tokens
    one sequence (the context window, or the whole KV cache when smaller), ``blocks`` KV blocks of
    ``block_size`` tokens."""

    budget: int
    rows: int
    room: int
    blocks: int
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cap(grid: Grid, name: str, limit: int, why: str, explicit: set[str]) -> tuple[int, ...]:
    """Values of ``grid.name`` up to ``limit``. A value the user gave past it is a ValueError; a
    default past it is dropped, and ``limit`` itself measured in its place."""
    values = getattr(grid, name)
    over = [v for v in values if v > limit]
    if name in explicit and over:
        raise ValueError(f"{_flag(name)} {over[0]}: {why}, at most {limit} here")
    kept = [v for v in values if v <= limit]
    if over and limit > (kept[-1] if kept else 0):
        kept.append(limit)
    return tuple(kept)


def fit_grid(grid: Grid, lim: Limits, explicit: set[str] = frozenset()) -> tuple[Grid, list[str]]:
    """``grid`` cut to what an engine with limits ``lim`` can hold, and a note for each point or
    combination left out. ValueError for a value in ``explicit`` (fields the user set) that the
    engine cannot hold, or when too few points are left to fit a model."""
    notes: list[str] = []
    bs = lim.block_size
    odd = [c for c in grid.cached_tokens if c % bs]
    if "cached_tokens" in explicit and odd:
        raise ValueError(f"--cached-tokens {odd[0]}: a cached prefix is whole KV blocks of {bs} tokens")
    room_c = lim.room - 1 - min(grid.cached_with)
    g = replace(
        grid,
        prefill_tokens=_cap(
            grid,
            "prefill_tokens",
            min(lim.budget, lim.room - 1),
            "a prompt step holds the step's token budget and "
            "a prompt plus its first token fit the context window and the KV cache",
            explicit,
        ),
        cached_tokens=tuple(sorted({c // bs * bs for c in grid.cached_tokens if bs <= c // bs * bs <= room_c})),
        batch_sizes=_cap(grid, "batch_sizes", lim.rows, "a step holds at most --max-num-seqs sequences", explicit),
        context_lens=_cap(
            grid,
            "context_lens",
            lim.room - grid.decode_margin,
            "a decoding sequence and the "
            f"{grid.decode_margin} tokens it produces while measured fit the context window and the KV cache",
            explicit,
        ),
        mixed_contexts=_cap(grid, "mixed_contexts", lim.room - grid.decode_margin, "", explicit),
        handoff_tokens=tuple(sorted({min(n, lim.room - 2) for n in grid.handoff_tokens} - {0, -1})),
    )
    if "cached_tokens" in explicit and len(g.cached_tokens) < len(grid.cached_tokens):
        raise ValueError(f"--cached-tokens {max(grid.cached_tokens)}: at most {room_c} here (context window)")
    left = [c for c in grid.cached_tokens if c not in g.cached_tokens]
    notes += [f"cached prefix of {c} tokens: past the context window or the KV cache" for c in left]
    big = [
        (b, n) for b in g.batch_sizes for n in g.context_lens if b * lim.blocks_for(n + g.decode_margin) > lim.blocks
    ]
    notes += [f"decode batch {b} x {n} tokens: more KV than the cache holds (raise --kv-cache-gib)" for b, n in big]
    run = set(batched_points(g, lim))
    notes += [
        f"step of {k} prompts of {n} tokens: past the step's token budget, --max-num-seqs or the KV cache"
        for k in g.batched_prompts
        for n in g.batched_tokens
        if (k, n) not in run
    ]
    run = set(mixed_points(g, lim))
    notes += [
        f"mixed step of {p} prompt tokens beside {d} sequences of {n} tokens: past the step's token budget, "
        "--max-num-seqs, the context window or the KV cache"
        for n in g.mixed_contexts
        for d in g.mixed_batch_sizes
        for p in g.mixed_prompt_tokens
        if (p, d, n) not in run
    ]
    if len(g.prefill_tokens) + len(cached_points(g, lim)) < 3 or len(g.handoff_tokens) < 2:
        raise ValueError("the context window or the KV cache leaves too few prompt lengths to fit a model")
    if len(decode_points(g, lim)) < 3:
        raise ValueError("the KV cache or --max-num-seqs leaves fewer than 3 decode points to fit a model")
    return g, notes


def cached_points(g: Grid, lim: Limits) -> list[tuple[int, int]]:
    """(prompt tokens, cached prefix tokens) of the cached-prefix prefill points."""
    return [(n, c) for c in g.cached_tokens for n in g.cached_with if n <= lim.budget and c + n < lim.room]


def batched_points(g: Grid, lim: Limits) -> list[tuple[int, int]]:
    """(prompts, tokens each) of the steps of several fresh prompts that fit one step and the cache."""
    return [
        (k, n)
        for k in g.batched_prompts
        for n in g.batched_tokens
        if 1 < k <= lim.rows and k * n <= lim.budget and n < lim.room and k * lim.blocks_for(n + 1) <= lim.blocks
    ]


def decode_points(g: Grid, lim: Limits) -> list[tuple[int, int]]:
    """(batch, context) of the decode points whose KV the cache holds."""
    return [
        (b, n) for n in g.context_lens for b in g.batch_sizes if b * lim.blocks_for(n + g.decode_margin) <= lim.blocks
    ]


def mixed_points(g: Grid, lim: Limits) -> list[tuple[int, int, int]]:
    """(prompt tokens, decoding sequences, their context) of the mixed points this engine can run as
    one step: the decode rows leave one row to the prompt, and both fit the token budget and the cache."""
    points = []
    for n in g.mixed_contexts:
        kv = lim.blocks_for(n + g.decode_margin)
        points += [
            (p, d, n)
            for d in g.mixed_batch_sizes
            for p in g.mixed_prompt_tokens
            if n + g.decode_margin <= lim.room
            and d < lim.rows
            and p + d <= lim.budget
            and p < lim.room
            and d * kv + lim.blocks_for(p + 1) <= lim.blocks
        ]
    return points
