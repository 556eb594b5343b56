"""Fixed-length synthetic workloads: --input-len/--output-len, --prompts random (no dataset, no server)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from pdserve.cli.bench import add_bench_parser, tokenizer_folder
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.args import build_specs
from pdserve.loadgen.prompts import PromptPool, RandomPromptPool, make_prompt_pool
from pdserve.loadgen.workload import fix_lengths, poisson_arrivals


@pytest.fixture(scope="module")
def tokenizer(embedded_dir) -> Tokenizer:
    return Tokenizer.from_folder(embedded_dir)


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


# --- fix_lengths ----------------------------------------------------------------------------------


def test_fix_lengths_replaces_both_sides_exactly():
    assert fix_lengths([(10, 3), (5000, 7)], 4096, 256, 64) == [(256, 64), (256, 64)]


def test_fix_lengths_one_side_trims_the_other_to_fit():
    assert fix_lengths([(10, 3), (4090, 7)], 4096, output_len=64) == [(10, 64), (4032, 64)]
    assert fix_lengths([(10, 3), (9, 4000)], 4096, input_len=256) == [(256, 3), (256, 3840)]


def test_fix_lengths_none_keeps_lengths():
    assert fix_lengths([(10, 3)], 16) == [(10, 3)]


@pytest.mark.parametrize("inp,out", [(4000, 200), (4096, None), (None, 4096)])
def test_fix_lengths_rejects_what_does_not_fit(inp, out):
    with pytest.raises(ValueError, match="more than the model's 4096"):
        fix_lengths([(1, 1)], 4096, inp, out)


def test_fix_lengths_rejects_non_positive():
    with pytest.raises(ValueError, match="input_len must be >= 1"):
        fix_lengths([(1, 1)], 4096, 0, 5)


# --- RandomPromptPool -----------------------------------------------------------------------------


def test_random_pool_exact_length_bos_and_no_special_ids(tokenizer):
    pool = RandomPromptPool(tokenizer, seed=0)
    specials = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    for n in (1, 2, 17, 256):
        ids, source = pool.make(n, random.Random(n))
        assert len(ids) == n and source == "random"
        assert ids[: len(pool.prefix)] == pool.prefix[:n]
        assert not set(ids[len(pool.prefix) :]) & specials
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert pool.prefix == (tokenizer.bos_token_id,)  # the embedded tokenizer adds BOS


def test_random_pool_is_seeded_and_varied(tokenizer):
    a = RandomPromptPool(tokenizer, seed=3).make(256, random.Random(7))[0]
    b = RandomPromptPool(tokenizer, seed=9).make(256, random.Random(7))[0]
    c = RandomPromptPool(tokenizer, seed=3).make(256, random.Random(8))[0]
    assert a == b != c
    assert len(set(a)) > 100  # spread over the vocabulary, not one id repeated
    with pytest.raises(ValueError):
        RandomPromptPool(tokenizer, 0).make(0)


def test_make_prompt_pool(tokenizer, tmp_path):
    assert isinstance(make_prompt_pool("random", tokenizer, 0, tmp_path), RandomPromptPool)
    with pytest.raises(ValueError, match="cannot be mixed"):
        make_prompt_pool("random,sharegpt", tokenizer, 0, tmp_path)
    with pytest.raises(FileNotFoundError):  # a real set still reads its file
        make_prompt_pool("vicuna", tokenizer, 0, tmp_path)


def test_make_prompt_pool_real_sets(tokenizer):
    try:
        pool = make_prompt_pool(" vicuna, mt-bench ", tokenizer, 0)
    except FileNotFoundError:
        pytest.skip("../shared/datasets is absent")
    assert isinstance(pool, PromptPool)
    assert {name for name, _ in pool.prompts} == {"vicuna", "mt-bench"}


# --- build_specs ----------------------------------------------------------------------------------

FIXED = (
    "--arrival",
    "poisson",
    "--rate",
    "2",
    "--num-requests",
    "12",
    "--input-len",
    "256",
    "--output-len",
    "64",
    "--prompts",
    "random",
    "--seed",
    "5",
)


def test_build_specs_fixed_random_needs_no_dataset(tokenizer, tmp_path):
    args = _bench_args(*FIXED, "--datasets-dir", str(tmp_path / "absent"))
    specs = build_specs(args, tokenizer, 4096, args.rate)
    assert len(specs) == 12
    assert [s.send_at_s for s in specs] == poisson_arrivals(2.0, 12, 5)
    for s in specs:
        assert len(s.prompt_token_ids) == 256 and s.max_tokens == 64
        assert s.prompt_source == "random" and s.prompt_token_ids[0] == tokenizer.bos_token_id
    assert len({s.prompt_token_ids for s in specs}) == 12  # every prompt differs


def test_build_specs_fixed_lengths_ignore_scale_and_caps(tokenizer, tmp_path):
    args = _bench_args(
        *FIXED,
        "--length-scale",
        "0.1",
        "--max-input-tokens",
        "8",
        "--max-output-tokens",
        "4",
        "--datasets-dir",
        str(tmp_path),
    )
    assert {(len(s.prompt_token_ids), s.max_tokens) for s in build_specs(args, tokenizer, 4096, 2.0)} == {(256, 64)}


def test_build_specs_same_prompts_at_every_rate(tokenizer, tmp_path):
    args = _bench_args(*FIXED, "--datasets-dir", str(tmp_path))
    slow, fast = build_specs(args, tokenizer, 4096, 1.0), build_specs(args, tokenizer, 4096, 8.0)
    assert [s.prompt_token_ids for s in slow] == [s.prompt_token_ids for s in fast]
    assert slow[-1].send_at_s == pytest.approx(8 * fast[-1].send_at_s)


def test_build_specs_gamma_fixed(tokenizer, tmp_path):
    args = _bench_args(*FIXED, "--datasets-dir", str(tmp_path))
    args.arrival, args.burstiness = "gamma", 0.5
    specs = build_specs(args, tokenizer, 4096, 4.0)
    assert len(specs) == 12 and {s.max_tokens for s in specs} == {64}


def test_build_specs_fixed_lengths_must_fit(tokenizer, tmp_path):
    args = _bench_args(*FIXED, "--datasets-dir", str(tmp_path))
    with pytest.raises(ValueError, match="more than the model's 300"):
        build_specs(args, tokenizer, 300, 2.0)


def test_build_specs_one_fixed_side_reads_the_trace(tokenizer, tmp_path):
    args = _bench_args(
        "--arrival",
        "poisson",
        "--rate",
        "2",
        "--num-requests",
        "4",
        "--output-len",
        "64",
        "--prompts",
        "random",
        "--datasets-dir",
        str(tmp_path),
    )
    with pytest.raises(FileNotFoundError, match="--datasets-dir"):
        build_specs(args, tokenizer, 4096, 2.0)


def test_build_specs_one_fixed_side_with_trace(tokenizer):
    args = _bench_args("--num-requests", "6", "--output-len", "9", "--length-scale", "0.05", "--prompts", "random")
    try:
        specs = build_specs(args, tokenizer, 4096, None)
    except FileNotFoundError:
        pytest.skip("../shared/datasets is absent")
    assert len(specs) == 6 and {s.max_tokens for s in specs} == {9}
    assert len({len(s.prompt_token_ids) for s in specs}) > 1  # inputs still follow the (scaled) trace


@pytest.mark.parametrize("flag", ["--input-len", "--output-len"])
def test_parser_rejects_non_positive_lengths(flag, capsys):
    with pytest.raises(SystemExit):
        _bench_args(flag, "0")
    assert "must be >= 1" in capsys.readouterr().err


# --- the tokenizer of the served model --------------------------------------------------------------


def test_the_tokenizer_folder_comes_from_the_served_id_or_a_folder(embedded_dir):
    assert Path(tokenizer_folder("embedded")) == embedded_dir  # pdserve serve --model embedded
    assert tokenizer_folder(str(embedded_dir)) == str(embedded_dir)  # a vLLM-style root path
    for served in ("test-model", "owner/name", "missing.gguf"):  # only a name: the folder must be given
        with pytest.raises(SystemExit, match="pass --tokenizer"):
            tokenizer_folder(served)


def test_missing_datasets_folder_names_every_place_searched(tmp_path, monkeypatch):
    from pdserve.loadgen import dataset_files

    monkeypatch.delenv(dataset_files.DATASETS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dataset_files, "__file__", str(tmp_path / "a" / "b" / "c" / "dataset_files.py"))
    with pytest.raises(FileNotFoundError) as info:
        dataset_files.dataset_file("x/y.csv")
    message = str(info.value)
    for place in dataset_files.default_datasets_dirs():
        assert str(place) in message
    assert "--datasets-dir" in message and "x/y.csv" in message
