"""BlockPrompts: prompts built from hash-id blocks, equal where the hash ids are."""

from __future__ import annotations

import random

import pytest

from pdserve.loadgen.prompt_datasets import load_prompts
from pdserve.loadgen.prompts import BlockPrompts, PromptPool, RandomPromptPool
from tests.loadgen._datasets import DATASETS


@pytest.fixture(params=["random", "text"])
def pool(request, tokenizer):
    if request.param == "random":
        return RandomPromptPool(tokenizer, seed=0)
    if not (DATASETS / "sharegpt_v3_500").is_dir():
        pytest.skip(f"{DATASETS} is absent")
    return PromptPool(load_prompts(["sharegpt", "belle-zh"], DATASETS), tokenizer, seed=0)


def test_shared_hash_ids_give_shared_token_prefixes(pool):
    blocks = BlockPrompts(pool, block_tokens=32, seed=4)
    p = len(pool.prefix)
    a, source = blocks.make([0, 14, 15, 16], 4 * 32 + p, random.Random(1))
    b, _ = blocks.make([0, 14, 28, 29], 4 * 32 + p, random.Random(2))
    assert len(a) == len(b) == 4 * 32 + p and a[:p] == pool.prefix
    assert a[: p + 2 * 32] == b[: p + 2 * 32]  # blocks 0 and 14
    assert a[p + 2 * 32 : p + 3 * 32] != b[p + 2 * 32 : p + 3 * 32]  # 15 vs 28
    assert source in ("random", "sharegpt", "belle-zh")
    again = BlockPrompts(pool, block_tokens=32, seed=4).make([0, 14, 15, 16], 4 * 32 + p, random.Random(9))[0]
    assert again == a  # blocks depend on (seed, hash id) only
    other = BlockPrompts(pool, block_tokens=32, seed=5).make([0, 14, 15, 16], 4 * 32 + p, random.Random(1))[0]
    assert other[p : p + 32] != a[p : p + 32]


def test_block_prompts_cut_and_fill(pool):
    blocks = BlockPrompts(pool, block_tokens=16, seed=0)
    p = len(pool.prefix)
    full = blocks.make([3, 4], 2 * 16 + p, random.Random(0))[0]
    cut = blocks.make([3, 4], 16 + p + 5, random.Random(0))[0]  # the last block cut to 5 tokens
    assert cut == full[: 16 + p + 5]
    filled = blocks.make([3, 4], 2 * 16 + p + 20, random.Random(0))[0]  # 20 tokens past the blocks
    assert len(filled) == 2 * 16 + p + 20 and filled[: 2 * 16 + p] == full
    assert blocks.make([3], 1, random.Random(0))[0] == full[:1]
    assert len(blocks.make([], 7, random.Random(0))[0]) == 7
    with pytest.raises(ValueError):
        blocks.make([3], 0, random.Random(0))
    with pytest.raises(ValueError):
        BlockPrompts(pool, 0, 0)
