"""Prompt text from real prompt sets, cut or joined to exact token counts.

The prompt sets' texts come from :mod:`pdserve.loadgen.prompt_datasets` (:data:`PROMPT_SETS`,
:func:`load_prompts`), read from the shared datasets folder.  :class:`PromptPool` turns those texts
into token ids of an exact length, so a replayed trace sends prompts whose
lengths match the trace: the load generator sends ids, not text, because
re-tokenizing cut text does not give a stable count.

:class:`RandomPromptPool` (``--prompts random``) needs no dataset: uniformly random token ids,
like vLLM's "random" benchmark dataset.

:class:`BlockPrompts` builds prompts for a trace that names its prompt blocks (Mooncake's
``hash_ids``) from either pool: equal ids give equal token blocks, so shared prefixes in the trace
are shared prefixes on the server.

Torch-free: only :mod:`pdserve.engine.text.tokenizer` (``tokenizers``) and the standard library.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.prompt_datasets import PROMPT_SETS, load_prompts

__all__ = [
    "RANDOM_PROMPTS",
    "PromptPool",
    "RandomPromptPool",
    "BlockPrompts",
    "prompt_set_names",
    "make_prompt_pool",
]

RANDOM_PROMPTS = "random"  # synthetic prompts: random token ids, no dataset


def _special_prefix(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer puts before a text's own ids (its BOS, when it adds one)."""
    probe = "Hello"
    full, plain = tokenizer.encode(probe), tokenizer.encode(probe, add_special_tokens=False)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(full[:i])
    return ()


class PromptPool:
    """Real prompts as token ids of an exact length.

    ``make(n, rng)`` picks a prompt uniformly among all given prompts, takes the
    tokenizer's special prefix (BOS, when the tokenizer adds one) plus the
    prompt's ids; if that is longer than ``n`` it is cut, if shorter further random
    prompts are appended, each after ``separator``'s ids and without BOS, until
    ``n`` ids are reached.  Tokenizations are cached per prompt.
    """

    def __init__(
        self, prompts: list[tuple[str, str]], tokenizer: Tokenizer, seed: int, *, separator: str = "\n\n"
    ) -> None:
        if not prompts:
            raise ValueError("PromptPool needs at least one prompt")
        self.prompts = list(prompts)
        self.tokenizer = tokenizer
        self.prefix = _special_prefix(tokenizer)
        self.separator_ids = tuple(tokenizer.encode(separator, add_special_tokens=False)) if separator else ()
        self._rng = random.Random(seed)  # used when make() is given no rng
        self._ids: dict[int, tuple[int, ...]] = {}
        self._empty: set[int] = set()  # prompts whose text tokenizes to nothing

    def ids(self, index: int) -> tuple[int, ...]:
        """Token ids of prompt ``index`` without special tokens (cached)."""
        cached = self._ids.get(index)
        if cached is None:
            cached = self._ids[index] = tuple(self.tokenizer.encode(self.prompts[index][1], add_special_tokens=False))
            if not cached:
                self._empty.add(index)
        return cached

    def _pick(self, rng: random.Random) -> int:
        """A random prompt with at least one token."""
        while True:
            if len(self._empty) == len(self.prompts):
                raise ValueError("every prompt in the pool tokenizes to zero tokens")
            index = rng.randrange(len(self.prompts))
            if self.ids(index):
                return index

    def fill(self, num_tokens: int, rng: random.Random) -> tuple[tuple[int, ...], str]:
        """(exactly ``num_tokens`` >= 0 ids of prompt text without special tokens, source set name
        of the first prompt used)."""
        first = self._pick(rng)
        ids = list(self.ids(first))
        while len(ids) < num_tokens:
            ids += self.separator_ids
            ids += self.ids(self._pick(rng))
        return tuple(ids[:num_tokens]), self.prompts[first][0]

    def make(self, num_tokens: int, rng: random.Random | None = None) -> tuple[tuple[int, ...], str]:
        """(exactly ``num_tokens`` token ids, source set name of the first prompt used)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        body, source = self.fill(max(0, num_tokens - len(self.prefix)), self._rng if rng is None else rng)
        return (self.prefix + body)[:num_tokens], source


class RandomPromptPool:
    """Synthetic prompts: uniformly random token ids of an exact length.

    ``make(n, rng)`` returns the tokenizer's special prefix (BOS, when it adds one) followed by
    ids drawn uniformly from the vocabulary without its special and EOS ids, cut to exactly ``n``:
    vLLM's "random" benchmark dataset, sent as ids so the count stays exact.
    """

    name = RANDOM_PROMPTS

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.prefix = _special_prefix(tokenizer)
        excluded = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
        if tokenizer.bos_token_id is not None:
            excluded.add(tokenizer.bos_token_id)
        self.allowed = [i for i in range(tokenizer.vocab_size) if i not in excluded]
        if not self.allowed:
            raise ValueError("the tokenizer has no ordinary (non-special) token ids to draw from")
        self._rng = random.Random(seed)

    def fill(self, num_tokens: int, rng: random.Random) -> tuple[tuple[int, ...], str]:
        """(exactly ``num_tokens`` >= 0 random ordinary ids, ``"random"``)."""
        return tuple(self.allowed[rng.randrange(len(self.allowed))] for _ in range(num_tokens)), self.name

    def make(self, num_tokens: int, rng: random.Random | None = None) -> tuple[tuple[int, ...], str]:
        """(exactly ``num_tokens`` token ids, ``"random"``)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        body, _ = self.fill(max(0, num_tokens - len(self.prefix)), self._rng if rng is None else rng)
        return (self.prefix + body)[:num_tokens], self.name


class BlockPrompts:
    """Prompts built from token blocks named by a trace's hash ids (Mooncake's ``hash_ids``).

    Block ``h`` is ``block_tokens`` ids of ``pool`` text (or random ids) drawn with an RNG seeded
    by ``(seed, h)`` alone, so equal ids give equal blocks; the trace chains each id on the one
    before it, so requests whose ids start alike get equal token prefixes over those blocks.
    ``make(hash_ids, n, rng)`` is the tokenizer's special prefix, then the blocks in order, cut to
    exactly ``n`` ids; when the blocks hold fewer, ids drawn from ``pool`` with ``rng`` (the
    request's own) fill the rest. Blocks are cached.
    """

    def __init__(self, pool: PromptPool | RandomPromptPool, block_tokens: int, seed: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.pool, self.block_tokens, self.seed = pool, block_tokens, seed
        self._blocks: dict[int, tuple[tuple[int, ...], str]] = {}

    def block(self, hash_id: int) -> tuple[tuple[int, ...], str]:
        """(the ``block_tokens`` ids of block ``hash_id``, source set name of its first prompt)."""
        cached = self._blocks.get(hash_id)
        if cached is None:
            cached = self._blocks[hash_id] = self.pool.fill(self.block_tokens, random.Random(f"{self.seed}:{hash_id}"))
        return cached

    def make(self, hash_ids: Sequence[int], num_tokens: int, rng: random.Random) -> tuple[tuple[int, ...], str]:
        """(exactly ``num_tokens`` ids: prefix, then the blocks of ``hash_ids``, then ``rng``'s fill;
        source set name of the first block, or of the fill when there is no block)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        ids, sources = list(self.pool.prefix), []
        for h in hash_ids:
            if len(ids) >= num_tokens and sources:
                break
            block, source = self.block(h)
            ids += block
            sources.append(source)
        if len(ids) < num_tokens or not sources:
            tail, source = self.pool.fill(max(0, num_tokens - len(ids)), rng)
            ids += tail
            sources.append(source)
        return tuple(ids[:num_tokens]), sources[0]


def prompt_set_names(names: str | Sequence[str]) -> list[str]:
    """The names of ``--prompts`` (comma-separated text, or a list), blanks dropped, checked before
    any file is read: prompt-set names of :data:`PROMPT_SETS`, or ``random`` alone.

    ValueError for no name, an unknown name (listing the valid ones, ``random`` among them) or
    ``random`` mixed with prompt sets.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names)
    valid = [*PROMPT_SETS, RANDOM_PROMPTS]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(
            f"unknown prompt set(s) {', '.join(unknown) if unknown else 'none given'}; valid: {', '.join(valid)}"
        )
    if RANDOM_PROMPTS in names and len(set(names)) > 1:
        raise ValueError(f"--prompts {RANDOM_PROMPTS} cannot be mixed with prompt sets, got {','.join(names)}")
    return names


def make_prompt_pool(
    names: str | Sequence[str], tokenizer: Tokenizer, seed: int, datasets_dir: str | Path | None = None
) -> PromptPool | RandomPromptPool:
    """The pool for ``--prompts``: comma-separated prompt-set names, or ``random`` alone.

    ValueError (from :func:`prompt_set_names`, before any file is read) for an unknown name or
    ``random`` mixed with prompt sets; FileNotFoundError when a set's file is absent.
    """
    names = prompt_set_names(names)
    if names[0] == RANDOM_PROMPTS:
        return RandomPromptPool(tokenizer, seed)
    return PromptPool(load_prompts(names, datasets_dir), tokenizer, seed)
