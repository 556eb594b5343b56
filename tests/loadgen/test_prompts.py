"""Prompt sets from the shared datasets and exact-length prompt token ids."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.prompt_datasets import PROMPT_SETS, load_prompts
from pdserve.loadgen.prompts import PromptPool

DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"
CJK = re.compile(r"[\u4e00-\u9fff]")
SIZES = {
    "sharegpt": 500,
    "arena-hard": 1250,
    "mt-bench": 80,
    "vicuna": 80,
    "belle-zh": 1000,
    "mt-bench-zh": 80,
    "arena-hard-zh": 79,
    "humaneval": 164,
}
FIRST = {
    "sharegpt": "How to stop automatic updates from the WSUS Server to a target machine",
    "arena-hard": "Use ABC notation to write a melody in the style of a folk tune.",
    "mt-bench": "Compose an engaging travel blog post about a recent trip to Hawaii",
    "vicuna": "How can I improve my time management skills?",
    "belle-zh": "请你写出一个可以生成五个不同随机数的 Python 程序。",
    "mt-bench-zh": "编写一篇关于最近去夏威夷旅行的吸引人的旅游博客文章",
    "arena-hard-zh": "uint8_t select_action(uint8_t state) {",
    "humaneval": "from typing import List\n\n\ndef has_close_elements(",
}


@pytest.fixture(scope="module")
def datasets_dir() -> Path:
    if not DATASETS.is_dir():
        pytest.skip(f"{DATASETS} is absent")
    return DATASETS


@pytest.fixture(scope="module")
def english(datasets_dir) -> list[tuple[str, str]]:
    return load_prompts(["vicuna", "mt-bench", "sharegpt", "humaneval"], datasets_dir)


@pytest.fixture(scope="module")
def tokenizers(embedded_dir) -> dict[str, Tokenizer]:
    from tests.conftest import STORIES

    toks = {"embedded": Tokenizer.from_folder(embedded_dir)}
    if (STORIES / "tokenizer.json").is_file():
        toks["stories260K"] = Tokenizer.from_folder(STORIES)
    return toks


@pytest.fixture(params=["embedded", "stories260K"])
def tok(request, tokenizers) -> Tokenizer:
    if request.param not in tokenizers:
        pytest.skip("stories260K-hf is absent")
    return tokenizers[request.param]


def test_prompt_sets_are_the_documented_ones():
    assert set(PROMPT_SETS) == set(SIZES)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_loader_returns_real_prompts(datasets_dir, name):
    texts = PROMPT_SETS[name](datasets_dir)
    assert len(texts) == SIZES[name]
    assert all(isinstance(t, str) and t.strip() for t in texts)
    assert texts[0].startswith(FIRST[name])
    assert len(set(texts)) > 0.9 * len(texts)  # not one field repeated (e.g. a category)


@pytest.mark.parametrize("name,share", [("belle-zh", 0.95), ("mt-bench-zh", 1.0), ("arena-hard-zh", 1.0)])
def test_chinese_sets_are_chinese(datasets_dir, name, share):
    texts = PROMPT_SETS[name](datasets_dir)
    assert sum(bool(CJK.search(t)) for t in texts) >= share * len(texts)


def test_english_sets_are_mostly_not_chinese(datasets_dir):
    for name in ("sharegpt", "mt-bench", "vicuna", "humaneval"):
        texts = PROMPT_SETS[name](datasets_dir)
        assert sum(bool(CJK.search(t)) for t in texts) <= 0.02 * len(texts)


def test_mt_bench_takes_the_first_turn_only(datasets_dir):
    rows = [json.loads(line) for line in (datasets_dir / "mt_bench" / "question.jsonl").open()]
    assert PROMPT_SETS["mt-bench"](datasets_dir) == [r["turns"][0] for r in rows]


def test_load_prompts(datasets_dir):
    got = load_prompts(["vicuna", "mt-bench-zh", "vicuna"], datasets_dir)
    assert [n for n, _ in got] == ["vicuna"] * 80 + ["mt-bench-zh"] * 80
    assert got[0] == ("vicuna", FIRST["vicuna"])
    with pytest.raises(ValueError, match="valid: .*sharegpt.*humaneval") as err:
        load_prompts(["vicuna", "alpaca"], datasets_dir)
    assert "alpaca" in str(err.value)
    with pytest.raises(ValueError):
        load_prompts([], datasets_dir)


def test_load_prompts_missing_dir(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--datasets-dir") as err:
        load_prompts(["humaneval"], tmp_path)
    assert str(tmp_path / "humaneval" / "HumanEval.jsonl.gz") in str(err.value)
    monkeypatch.setenv("PDSERVE_DATASETS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_prompts(["vicuna"])


def _sources_starting(text: str, prompts: list[tuple[str, str]]) -> set[str]:
    """Sets with a prompt that ``text`` begins with (first 40 characters; leading spaces aside)."""
    head = text.lstrip(" ")
    return {n for n, p in prompts if head.startswith(p.lstrip(" ")[:40])}


@pytest.mark.parametrize("n", [1, 7, 300, 3000])
def test_make_gives_exactly_n_ids(english, tok, n):
    pool = PromptPool(english, tok, seed=0)
    rng = random.Random(n)
    for _ in range(5):
        ids, source = pool.make(n, rng)
        assert isinstance(ids, tuple) and len(ids) == n
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert ids[0] == tok.bos_token_id  # both test tokenizers add BOS
        assert tok.bos_token_id not in ids[1:]  # only the first prompt brings one
        if n >= 300:
            text = tok.decode(ids)
            assert len(text) > n  # real text, several characters a token
            assert source in _sources_starting(text, english)


def test_make_builds_prefix_prompt_separator_prompt(english, tok):
    text = english[0][1]  # vicuna q1: a few tokens long
    pool = PromptPool([("vicuna", text)], tok, seed=0)
    full, plain = tok.encode(text), tok.encode(text, add_special_tokens=False)
    sep = tok.encode("\n\n", add_special_tokens=False)
    assert pool.make(5, random.Random(0)) == (tuple(full[:5]), "vicuna")
    ids, _ = pool.make(100, random.Random(0))
    assert list(ids) == (full + (sep + plain) * 20)[:100]
    decoded = tok.decode(ids)
    assert decoded.startswith(text) and decoded[len(text) :].lstrip(" ").startswith("\n\n")


def test_make_without_bos(english, embedded_dir, tmp_path):
    folder = tmp_path / "nobos"
    shutil.copytree(embedded_dir, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = None  # this tokenizer adds no BOS
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_folder(folder)
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)
    pool = PromptPool(english, tok, seed=0)
    rng = random.Random(1)
    for n in (1, 7, 300):
        ids, source = pool.make(n, rng)
        assert len(ids) == n and tok.bos_token_id not in ids
    assert source in _sources_starting(tok.decode(ids), english)


def test_make_is_deterministic_and_cached(english, tok):
    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def encode(self, text, add_special_tokens=True):
            self.calls += 1
            return self.inner.encode(text, add_special_tokens)

    counting = Counting(tok)
    a, b = PromptPool(english, counting, seed=3), PromptPool(english, tok, seed=3)
    first = [a.make(500, random.Random(9)) for _ in range(2)]
    assert first[0] == first[1] == b.make(500, random.Random(9))
    calls = counting.calls
    assert a.make(500, random.Random(9)) == first[0] and counting.calls == calls  # all from the cache
    assert a.make(500, random.Random(10)) != first[0]
    # the pool's own seeded generator when no rng is passed
    assert [PromptPool(english, tok, seed=5).make(50) for _ in range(2)] == [
        PromptPool(english, tok, seed=5).make(50) for _ in range(2)
    ]


def test_make_chinese_prompts(datasets_dir, tok):
    zh = load_prompts(["belle-zh", "mt-bench-zh", "arena-hard-zh"], datasets_dir)
    pool = PromptPool(zh, tok, seed=0)
    ids, source = pool.make(300, random.Random(2))
    assert len(ids) == 300 and source in ("belle-zh", "mt-bench-zh", "arena-hard-zh")
    assert CJK.search(tok.decode(ids))


def test_make_rejects(english, tok):
    pool = PromptPool(english, tok, seed=0)
    for n in (0, -3):
        with pytest.raises(ValueError):
            pool.make(n, random.Random(0))
    with pytest.raises(ValueError):
        PromptPool([], tok, seed=0)
    with pytest.raises(ValueError, match="zero tokens"):
        PromptPool([("x", "")], tok, seed=0).make(3, random.Random(0))


def test_make_appends_different_random_prompts(datasets_dir, tok):
    vicuna = load_prompts(["vicuna"], datasets_dir)  # one-line questions, no blank lines inside
    pool = PromptPool(vicuna, tok, seed=0)
    ids, _ = pool.make(400, random.Random(4))
    pieces = [p.strip() for p in tok.decode(ids).split("\n\n")][:-1]  # the last one is cut
    assert len(pieces) >= 5 and len(set(pieces)) >= len(pieces) - 1
    assert all(p in {t for _, t in vicuna} for p in pieces)
