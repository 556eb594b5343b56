"""Mooncake traces: the JSONL loader, tie spreading, prompts built from hash-id blocks, and build_specs."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from pdserve.cli.bench import add_bench_parser
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.args import build_specs
from pdserve.loadgen.metrics import prefix_reuse_ceiling
from pdserve.loadgen.mooncake import BLOCK_TOKENS, CONVERSATION_KEY_BLOCKS, spread_ties
from pdserve.loadgen.prompt_datasets import load_prompts
from pdserve.loadgen.prompts import BlockPrompts, PromptPool, RandomPromptPool
from pdserve.loadgen.workload import (
    TRACES,
    TraceRow,
    clip_lengths,
    load_trace,
    sample_conversations,
    scale_to_rate,
    window,
)

DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"
MOONCAKE = DATASETS / "mooncake_fast25_traces"


@pytest.fixture(scope="module")
def datasets_dir() -> Path:
    if not MOONCAKE.is_dir():
        pytest.skip(f"{MOONCAKE} is absent")
    return DATASETS


@pytest.fixture(scope="module")
def conversation(datasets_dir) -> list[TraceRow]:
    return load_trace("mooncake-conversation", datasets_dir)


@pytest.fixture(scope="module")
def tokenizer(embedded_dir) -> Tokenizer:
    return Tokenizer.from_folder(embedded_dir)


def _raw(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATASETS / TRACES[name]).read_text().splitlines()]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --- loader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,count,span_s", [("mooncake-conversation", 12_031, 3_537.0), ("mooncake-synthetic", 3_993, 1_022.025)]
)
def test_load_trace_mooncake_keeps_every_field(datasets_dir, name, count, span_s):
    rows, raw = load_trace(name, datasets_dir), _raw(name)
    assert len(rows) == len(raw) == count
    assert [(r.input_tokens, r.output_tokens, list(r.hash_ids)) for r in rows] == [
        (d["input_length"], d["output_length"], d["hash_ids"]) for d in raw
    ]
    assert rows[0].t_s == 0.0 and all(b.t_s >= a.t_s for a, b in zip(rows, rows[1:]))
    ms0 = raw[0]["timestamp"]
    bucket_ends = sorted({d["timestamp"] for d in raw})
    following = dict(zip(bucket_ends, bucket_ends[1:] + [None]))
    for r, d in zip(rows, raw):  # each row stays inside its timestamp bucket
        start = (d["timestamp"] - ms0) / 1e3
        end = following[d["timestamp"]]
        assert start <= r.t_s and (end is None or r.t_s < (end - ms0) / 1e3)
    assert rows[-1].t_s >= span_s


def test_conversation_ties_are_spread(conversation):
    assert conversation[1].t_s == pytest.approx(0.3)  # 10 requests at 0 ms, the next bucket at 3,000 ms
    assert len({r.t_s for r in conversation}) == len(conversation)


def test_window_and_rate_keep_hash_ids(conversation):
    w = window(conversation, start_s=60.0, max_requests=30)
    assert [r.hash_ids for r in w] == [r.hash_ids for r in conversation if r.t_s >= 60.0][:30]
    assert [r.hash_ids for r in scale_to_rate(w, 5.0)] == [r.hash_ids for r in w]


def _write(tmp_path: Path, *rows: object) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _row(ms: int, inp: int = 600, out: int = 5, ids: object = (1, 2)) -> dict:
    return {"timestamp": ms, "input_length": inp, "output_length": out, "hash_ids": list(ids)}


def test_load_trace_small_file(tmp_path):
    rows = load_trace(_write(tmp_path, _row(1000), _row(1000, ids=(1, 3)), "", _row(4000, 10, 1, (7,))))
    assert rows == [TraceRow(0.0, 600, 5, (1, 2)), TraceRow(1.5, 600, 5, (1, 3)), TraceRow(3.0, 10, 1, (7,))]


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        "[1, 2]",
        {"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]},
        _row(5, inp=-1),
        _row(5, out=True),
        _row(5, ids=(1,)),
        _row(5, ids=(1, "2")),
        _row(5, ids=(1, -2)),
        _row(0),  # earlier than the row before
    ],
)
def test_load_trace_malformed_rows_give_line_number(tmp_path, bad):
    with pytest.raises(ValueError, match="t.jsonl:2:"):
        load_trace(_write(tmp_path, _row(1), bad, _row(9)))


def test_spread_ties():
    assert spread_ties([0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0]) == [0.0, 1.0, 2.0, 3.0, 4.5, 6.0, 7.5]
    assert spread_ties([1.0, 2.0, 10.0]) == [1.0, 2.0, 10.0]
    assert spread_ties([2.0, 2.0]) == [2.0, 2.0]  # one distinct time: no gap to spread over
    assert spread_ties([]) == []


# --- BlockPrompts ---------------------------------------------------------------------------------


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


def test_real_rows_sharing_fourteen_blocks(conversation, tokenizer):
    """Rows 2 and 138 of the conversation trace share hash ids 0, 14, ..., 26 and then differ."""
    a, b = conversation[1], conversation[137]
    assert a.hash_ids[:14] == b.hash_ids[:14] and a.hash_ids[14] != b.hash_ids[14]
    blocks = BlockPrompts(RandomPromptPool(tokenizer, 0), 32, seed=0)
    pa, pb = (blocks.make(r.hash_ids, round(r.input_tokens / 16), random.Random(i))[0] for i, r in enumerate((a, b)))
    assert _common_prefix(pa, pb) == 1 + 14 * 32  # BOS, then 14 blocks of 32 tokens


# --- build_specs ----------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


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
