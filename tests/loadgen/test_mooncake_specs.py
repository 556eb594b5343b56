"""Mooncake traces as bench workloads: build_specs shares prompt prefixes as the trace shares hash ids,
conversations sampled whole, and the prefix-reuse ceiling."""

from __future__ import annotations

import argparse
import random

import pytest

from pdserve.cli.bench import add_bench_parser
from pdserve.loadgen.args import build_specs
from pdserve.loadgen.metrics import prefix_reuse_ceiling
from pdserve.loadgen.mooncake import BLOCK_TOKENS, CONVERSATION_KEY_BLOCKS
from pdserve.loadgen.prompts import BlockPrompts, RandomPromptPool
from pdserve.loadgen.workload import TraceRow, clip_lengths, sample_conversations

DATASET = "mooncake_fast25_traces"  # the datasets_dir fixture (conftest.py) skips when it is absent


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_real_rows_sharing_fourteen_blocks(conversation, tokenizer):
    """Rows 2 and 138 of the conversation trace share hash ids 0, 14, ..., 26 and then differ."""
    a, b = conversation[1], conversation[137]
    assert a.hash_ids[:14] == b.hash_ids[:14] and a.hash_ids[14] != b.hash_ids[14]
    blocks = BlockPrompts(RandomPromptPool(tokenizer, 0), 32, seed=0)
    pa, pb = (blocks.make(r.hash_ids, round(r.input_tokens / 16), random.Random(i))[0] for i, r in enumerate((a, b)))
    assert _common_prefix(pa, pb) == 1 + 14 * 32  # BOS, then 14 blocks of 32 tokens


# --- build_specs ----------------------------------------------------------------------------------


def test_build_specs_mooncake_shares_prefixes_as_the_trace_does(conversation, tokenizer):
    args = _args(
        "--trace", "mooncake-conversation", "--length-scale", "0.0625", "--num-requests", "150", "--prompts", "random"
    )
    specs = build_specs(args, tokenizer, 2048, None)
    rows = conversation[:150]
    assert [s.send_at_s for s in specs] == [r.t_s for r in rows]
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in specs] == [
        clip_lengths(r.input_tokens, r.output_tokens, 2048, 0.0625) for r in rows
    ]
    block = round(BLOCK_TOKENS * 0.0625)
    shared_pairs = 0
    for i in range(len(rows)):
        for j in range(i):
            ids = zip(rows[i].hash_ids, rows[j].hash_ids)
            blocks = next((k for k, (x, y) in enumerate(ids) if x != y), None)
            a, b = specs[i].prompt_token_ids, specs[j].prompt_token_ids
            expected = min(1 + block * (blocks if blocks is not None else 10**9), len(a), len(b))
            assert _common_prefix(a, b) >= expected  # equal over the shared blocks
            if blocks is not None and expected < min(len(a), len(b)):
                assert _common_prefix(a, b) < expected + block  # and different within the next one
            shared_pairs += blocks is None or blocks > 1
    assert shared_pairs >= 3  # beside block 0, which every row shares, e.g. rows 2 and 138 share 14 blocks
    assert build_specs(args, tokenizer, 2048, None) == specs


def test_build_specs_mooncake_with_synthetic_arrivals_keeps_the_blocks(conversation, tokenizer):
    args = _args(
        "--trace",
        "mooncake-conversation",
        "--arrival",
        "poisson",
        "--rate",
        "4",
        "--num-requests",
        "40",
        "--length-scale",
        "0.0625",
        "--prompts",
        "random",
        "--input-len",
        "700",
    )
    specs = build_specs(args, tokenizer, 2048, 4.0)
    blocks = BlockPrompts(RandomPromptPool(tokenizer, 0), 32, seed=0)
    first = blocks.block(0)[0]  # every conversation row starts with hash id 0
    assert all(len(s.prompt_token_ids) == 700 for s in specs)
    assert all(s.prompt_token_ids[1:33] == first for s in specs)


# --- conversation sampling and the reuse ceiling --------------------------------------------------


def test_conversation_sample_keeps_whole_conversations(conversation):
    kept = sample_conversations(conversation, 1 / 16, seed=0)
    assert 0.04 < len(kept) / len(conversation) < 0.09  # about 1/16 of the requests
    families = {r.hash_ids[:CONVERSATION_KEY_BLOCKS] for r in kept}
    assert [r for r in conversation if r.hash_ids[:CONVERSATION_KEY_BLOCKS] in families] == kept  # every turn
    assert [r.t_s for r in kept] == sorted(r.t_s for r in kept)
    other = sample_conversations(conversation, 1 / 16, seed=1)
    assert {r.hash_ids[:CONVERSATION_KEY_BLOCKS] for r in other} != families
    assert sample_conversations(conversation, None) == conversation
    assert sample_conversations(conversation, 1.0) == conversation


def test_conversation_sample_raises_the_reuse_of_a_short_run(conversation, tokenizer):
    """The first 200 requests of the hour are mostly first turns; 200 requests of a 1/16 sample of
    conversations reuse about as much as the whole hour (37% of its blocks)."""

    def ceiling(rows):
        return prefix_reuse_ceiling([sum(([h] * 16 for h in r.hash_ids), []) for r in rows])

    first = ceiling(conversation[:200])
    sampled = ceiling(sample_conversations(conversation, 1 / 16)[:200])
    assert first < 0.1 < 0.25 < sampled
    args = _args(
        "--trace",
        "mooncake-conversation",
        "--conversation-sample",
        "0.0625",
        "--num-requests",
        "200",
        "--length-scale",
        "0.03125",
        "--prompts",
        "random",
    )
    specs = build_specs(args, tokenizer, 2048, 1.5)
    assert abs(prefix_reuse_ceiling([s.prompt_token_ids for s in specs]) - sampled) < 0.05  # same reuse in tokens


def test_an_empty_conversation_sample_says_so(conversation, tokenizer):
    args = _args("--trace", "mooncake-conversation", "--conversation-sample", "1e-9", "--prompts", "random")
    with pytest.raises(ValueError, match="kept no requests"):
        build_specs(args, tokenizer, 2048, 1.0)


def test_conversation_sample_needs_hash_ids():
    with pytest.raises(ValueError, match="hash ids"):
        sample_conversations([TraceRow(0.0, 10, 10)], 0.5)
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            _args("--conversation-sample", bad)


def test_prefix_reuse_ceiling_counts_full_blocks_only():
    a = list(range(40))  # 2 full blocks of 16 + 8 tokens
    assert prefix_reuse_ceiling([a]) == 0.0
    assert prefix_reuse_ceiling([a, a]) == 32 / 80  # the second hits its 2 full blocks
    b = a[:16] + [99] * 24  # shares the first block only
    assert prefix_reuse_ceiling([a, b]) == 16 / 80
    assert prefix_reuse_ceiling([b[16:] + a[:16], a]) == 0.0  # the same block at another position is no prefix
    assert prefix_reuse_ceiling([]) == 0.0
    with pytest.raises(ValueError):
        prefix_reuse_ceiling([a], block_size=0)
