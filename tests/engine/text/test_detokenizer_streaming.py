"""pdserve.engine.text.detokenizer: streaming equals one-shot decode, however the ids are chunked and
whatever the decoder, without partial characters and within a bounded window."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from tests.engine.text._detokenize import CJK_EMOJI, stream
from tests.engine.text._tokenizers import SAMPLE_TEXTS, make_variant

# Synthetic decoders built on the stories vocabulary.
_METASPACE = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
    ],
}
_STRIP_PER_TOKEN = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        {"type": "ByteFallback"},
    ],
}
_UNKNOWN = {"type": "BPEDecoder", "suffix": "e"}  # not windowable: exercises the decode-everything path


@pytest.fixture(scope="module", params=["metaspace", "strip_per_token", "unknown"])
def variant_tok(request, stories_dir, tmp_path_factory):
    decoder = {"metaspace": _METASPACE, "strip_per_token": _STRIP_PER_TOKEN, "unknown": _UNKNOWN}[request.param]
    folder = make_variant(stories_dir, tmp_path_factory.mktemp(request.param), tokenizer={"decoder": decoder})
    return Tokenizer.from_folder(folder)


@pytest.mark.parametrize("how", [1, 2, 3, 7, "random", "all"])
def test_invariant_on_real_text(tok, how):
    rng = random.Random(7)
    for text in SAMPLE_TEXTS + CJK_EMOJI:
        ids = tok.encode(text) + [min(tok.eos_token_ids)]
        _, pieces, tail = stream(tok, ids, how, rng=rng)
        assert "".join(pieces) + tail == tok.decode(ids)


def _random_ids(tok, rng):
    n = rng.choice([1, 2, 4, 10, 40, 120])
    if rng.random() < 0.6:  # uniform ids, a few beyond the vocabulary
        return [rng.randrange(tok.vocab_size + 4) for _ in range(n)]
    ids = tok.encode(rng.choice(SAMPLE_TEXTS + CJK_EMOJI) * rng.randint(1, 4))
    for _ in range(rng.randint(1, 6)):  # splice in random ids
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(tok.vocab_size))
    return ids


def _check_random(tok, seed, cases=300, max_len=None):
    rng = random.Random(seed)
    for _ in range(cases):
        ids = _random_ids(tok, rng)[:max_len]
        expected = tok.decode(ids)
        for how in (1, rng.choice([2, 3, 5]), "random"):
            _, pieces, tail = stream(tok, ids, how, rng=rng)
            assert "".join(pieces) + tail == expected, (ids, how)


def test_invariant_on_random_ids(tok):
    _check_random(tok, seed=42)


def test_invariant_on_other_decoders(variant_tok):
    _check_random(variant_tok, seed=5, cases=150, max_len=300)  # the fallback path is O(n) per call
    for text in SAMPLE_TEXTS:
        ids = variant_tok.encode(text)
        _, pieces, tail = stream(variant_tok, ids, 1)
        assert "".join(pieces) + tail == variant_tok.decode(ids)


def test_metaspace_window_keeps_spaces(stories_dir, tmp_path):
    """A window starting on a '▁word' token must keep the space the one-shot decode keeps."""
    folder = make_variant(stories_dir, tmp_path / "m", tokenizer={"decoder": _METASPACE})
    mt = Tokenizer.from_folder(folder)
    ids = mt.encode(" ".join(["the cat sat on the mat"] * 60))
    _, pieces, tail = stream(mt, ids, 1)
    assert "".join(pieces) + tail == mt.decode(ids)
    assert mt.decode(ids).count(" ") == 60 * 6 - 1


def test_no_replacement_char_for_valid_text(tok):
    split_chars = 0
    for text in CJK_EMOJI * 2 + SAMPLE_TEXTS:
        ids = tok.encode(text)
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        for how in (1, 2, 3):
            det, pieces, tail = stream(tok, ids, how)
            assert all("\ufffd" not in p for p in pieces), (text, pieces)
            assert "".join(pieces) + tail == tok.decode(ids)
            assert "\ufffd" not in tail
    assert split_chars > 10  # the texts really put partial characters into single tokens


def test_invalid_bytes_become_replacement_at_finish(tok):
    lone_byte = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")
    ids = tok.encode("ok ") + [lone_byte]
    det, pieces, tail = stream(tok, ids, 1)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert tail.endswith("\ufffd") and "\ufffd" not in "".join(pieces)


def test_window_stays_bounded(tok):
    """Each add() decodes a bounded window, not the whole output."""

    class Recorder:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    watched = Tokenizer(
        Recorder(tok.backend),
        content_hash=tok.content_hash,
        eos_token_ids=tok.eos_token_ids,
        bos_token_id=tok.bos_token_id,
        model_max_length=tok.model_max_length,
        decoder_config=tok.decoder_config,
    )
    ids = tok.encode("Once upon a time there was a girl. 她很开心 😀! " * 80)
    assert len(ids) > 2000
    det, pieces, tail = stream(watched, ids, 1)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert watched.backend.longest <= 40
