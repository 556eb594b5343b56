"""Tests for pdserve.engine.text.tokenizer: parity with transformers.AutoTokenizer."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import textwrap

import pytest

from pdserve.engine.text.tokenizer import Tokenizer, TokenizerError
from tests.conftest import REPO
from tests.engine.text._tokenizers import (
    SAMPLE_TEXTS,
    make_variant,
)

transformers = pytest.importorskip("transformers")


def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_stories_known_values(stories_dir):
    tok = Tokenizer.from_folder(stories_dir)
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.encode("Lily and Tom went to the park") == [1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433]
    assert tok.eos_token_ids == frozenset({2})
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 512
    assert tok.model_max_length == tok.max_model_len == 2048
    assert tok.content_hash == hashlib.sha256((stories_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.decode([1, 403, 407, 261, 378, 2]) == "Once upon a time"


def test_bytelevel_values(bytelevel_dir):
    tok = Tokenizer.from_folder(bytelevel_dir)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({1})
    assert tok.max_model_len == 256
    assert tok.encode("Hello")[0] == 0


@pytest.mark.parametrize("text", SAMPLE_TEXTS, ids=range(len(SAMPLE_TEXTS)))
def test_encode_decode_match_autotokenizer(any_dir, text):
    ours, ref = Tokenizer.from_folder(any_dir), hf(any_dir)
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids) == hf_decode(ref, ids)
    assert ours.vocab_size == len(ref)


@pytest.mark.parametrize("text", ["<s>hi</s>", "<|bos|>hi<|eos|>", "a <|tool|> b", "<unk>"])
def test_special_token_text_matches_autotokenizer(any_dir, text):
    ours, ref = Tokenizer.from_folder(any_dir), hf(any_dir)
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_bos_added_once(any_dir):
    tok = Tokenizer.from_folder(any_dir)
    ids = tok.encode("Once upon a time")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.encode("")[0] == tok.bos_token_id and len(tok.encode("")) == 1


def test_decode_random_ids_matches_autotokenizer(any_dir):
    ours, ref = Tokenizer.from_folder(any_dir), hf(any_dir)
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(0, 40))]
        assert ours.decode(ids) == hf_decode(ref, ids), ids
    assert ours.decode([ours.vocab_size + 10, 2**40]) == ""


_BOS_EOS_PP = {
    "type": "TemplateProcessing",
    "single": [
        {"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|eos|>", "type_id": 0}},
    ],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {
        "<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]},
        "<|eos|>": {"id": "<|eos|>", "ids": [1], "tokens": ["<|eos|>"]},
    },
}

# With a tokenizer.json present, transformers v5 lets its post-processor alone decide
# on BOS/EOS; add_bos_token / add_eos_token in tokenizer_config are ignored.
BOS_VARIANTS = {
    # tokenizer.json edits, tokenizer_config.json edits, expected (bos, eos) presence
    "post_processor_only": ({}, {}, (True, False)),
    "config_says_no_bos": ({}, {"add_bos_token": False}, (True, False)),
    "config_bos_and_pp": ({}, {"add_bos_token": True}, (True, False)),
    "config_bos_eos": ({}, {"add_bos_token": True, "add_eos_token": True}, (True, False)),
    "pp_bos_eos": ({"post_processor": _BOS_EOS_PP}, {}, (True, True)),
    "no_pp_config_bos": ({"post_processor": None}, {"add_bos_token": True}, (False, False)),
    "no_pp_no_flag": ({"post_processor": None}, {}, (False, False)),
}


@pytest.mark.parametrize("name", BOS_VARIANTS)
def test_bos_rules_match_autotokenizer(bytelevel_dir, tmp_path, name):
    tj, tc, (has_bos, has_eos) = BOS_VARIANTS[name]
    folder = make_variant(bytelevel_dir, tmp_path / name, tokenizer=tj, tokenizer_config=tc)
    ours, ref = Tokenizer.from_folder(folder), hf(folder)
    for text in ["Hello 你好 😀", "", "Lily"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids.count(0) == int(has_bos) and (ids[:1] == [0]) == has_bos
        assert ids.count(1) == int(has_eos) and (ids[-1:] == [1]) == has_eos


@pytest.mark.parametrize(
    "tc",
    [
        {"add_bos_token": ...},
        {"add_bos_token": False},
        {"tokenizer_class": "LlamaTokenizer"},
        {"tokenizer_class": "LlamaTokenizerFast", "add_eos_token": True},
    ],
)
def test_stories_config_flags_keep_single_bos(stories_dir, tmp_path, tc):
    folder = make_variant(stories_dir, tmp_path / "s", tokenizer_config=tc)
    ours, ref = Tokenizer.from_folder(folder), hf(folder)
    assert ours.encode("Once upon a time") == ref("Once upon a time")["input_ids"] == [1, 403, 407, 261, 378]


def test_stories_without_post_processor_matches(stories_dir, tmp_path):
    folder = make_variant(stories_dir, tmp_path / "s", tokenizer={"post_processor": None})
    ours, ref = Tokenizer.from_folder(folder), hf(folder)
    assert ours.encode("Once upon a time") == ref("Once upon a time")["input_ids"] == [403, 407, 261, 378]


def test_special_token_missing_from_tokenizer_json_is_added(bytelevel_dir, tmp_path):
    folder = make_variant(bytelevel_dir, tmp_path / "pad", tokenizer_config={"pad_token": "<|pad|>"})
    ours, ref = Tokenizer.from_folder(folder), hf(folder)
    assert ours.vocab_size == len(ref) == Tokenizer.from_folder(bytelevel_dir).vocab_size + 1
    for text in ["x<|pad|>y", "<|pad|>"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ours.decode(ids) == hf_decode(ref, ids)


def test_eos_ids_union(bytelevel_dir, tmp_path):
    folder = make_variant(
        bytelevel_dir, tmp_path / "eos", config={"eos_token_id": 5}, generation_config={"eos_token_id": [1, 7]}
    )
    assert Tokenizer.from_folder(folder).eos_token_ids == frozenset({1, 5, 7})
    folder = make_variant(
        bytelevel_dir,
        tmp_path / "eos2",
        config={"eos_token_id": [9, 10]},
        generation_config={"eos_token_id": 11},
        tokenizer_config={"eos_token": ...},
    )
    assert Tokenizer.from_folder(folder).eos_token_ids == frozenset({9, 10, 11})


def test_bos_falls_back_to_config(bytelevel_dir, tmp_path):
    folder = make_variant(
        bytelevel_dir, tmp_path / "b", tokenizer_config={"bos_token": ...}, config={"bos_token_id": 0}
    )
    assert Tokenizer.from_folder(folder).bos_token_id == 0
    folder = make_variant(
        bytelevel_dir, tmp_path / "c", tokenizer_config={"bos_token": ...}, config={"bos_token_id": ...}
    )
    assert Tokenizer.from_folder(folder).bos_token_id is None


def test_max_len_fallback_and_error(bytelevel_dir, tmp_path):
    folder = make_variant(
        bytelevel_dir,
        tmp_path / "m",
        config={"max_position_embeddings": ...},
        tokenizer_config={"model_max_length": 777},
    )
    assert Tokenizer.from_folder(folder).max_model_len == 777
    folder = make_variant(bytelevel_dir, tmp_path / "n", config={"max_position_embeddings": ...})
    with pytest.raises(TokenizerError, match="max_position_embeddings"):
        Tokenizer.from_folder(folder)


def test_content_hash_tracks_tokenizer_json(bytelevel_dir, tmp_path):
    a = Tokenizer.from_folder(bytelevel_dir).content_hash
    assert a == Tokenizer.from_folder(bytelevel_dir).content_hash and len(a) == 64
    folder = make_variant(bytelevel_dir, tmp_path / "h", tokenizer={"truncation": None, "padding": None})
    other = (folder / "tokenizer.json").read_bytes()
    assert Tokenizer.from_folder(folder).content_hash == hashlib.sha256(other).hexdigest()


def test_missing_files_raise(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot parse"):
        Tokenizer.from_folder(tmp_path)


def test_malformed_config_raises(bytelevel_dir, tmp_path):
    folder = make_variant(bytelevel_dir, tmp_path / "bad")
    (folder / "config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="config.json"):
        Tokenizer.from_folder(folder)


def test_bad_inputs_raise(bytelevel_dir):
    tok = Tokenizer.from_folder(bytelevel_dir)
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError):
        tok.decode([5, -1])
    with pytest.raises(TokenizerError):
        tok.decode([1.5])  # type: ignore[list-item]
    assert isinstance(TokenizerError("x"), ValueError)


def test_modules_do_not_import_torch_or_transformers(bytelevel_dir):
    code = textwrap.dedent(f"""
        import sys
        from pdserve.engine.text.tokenizer import Tokenizer
        from pdserve.engine.text.detokenizer import IncrementalDetokenizer
        tok = Tokenizer.from_folder({str(bytelevel_dir)!r})
        det = IncrementalDetokenizer(tok, stop=["zzz"])
        det.add(tok.encode("Hello 你好 😀"))
        det.finish()
        loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not loaded, loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
