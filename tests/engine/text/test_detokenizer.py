"""Tests for pdserve.engine.text.detokenizer: streaming equals one-shot decode, stop strings."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.tokenizer import Tokenizer, TokenizerError
from tests.engine.text._tokenizers import (
    SAMPLE_TEXTS,
    make_variant,
)

CJK_EMOJI = [
    "你好世界",
    "今天天气很好，我们去公园玩吧。",
    "😀😃🎉👍",
    "猫🐱狗🐶 and 鸟",
    "👨‍👩‍👧 家庭",
    "ｆｕｌｌ　ｗｉｄｔｈ",
]


def chunks(ids, how, rng):
    """Split ``ids`` into add() calls: ``how`` is an int size, "random" or "all"."""
    if how == "all":
        return [list(ids)]
    out, i = [], 0
    while i < len(ids):
        size = rng.choice([0, 1, 1, 2, 3, 5, 9]) if how == "random" else how
        out.append(list(ids[i : i + size]))
        i += size
    return out


def stream(tok, ids, how=1, stop=(), rng=None):
    det = IncrementalDetokenizer(tok, stop=stop)
    pieces = [det.add(c) for c in chunks(ids, how, rng or random.Random(0))]
    return det, pieces, det.finish()


@pytest.fixture(scope="module")
def tok(any_dir):
    return Tokenizer.from_folder(any_dir)


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


# ---------------------------------------------------------------- stop strings


def test_stop_single(tok):
    ids = tok.encode("Once upon a time there was a girl")
    det, pieces, tail = stream(tok, ids, 1, stop=["there"])
    assert det.stopped and tail == ""
    assert "".join(pieces) == det.text == "Once upon a time "


def test_stop_several_earliest_wins(tok):
    ids = tok.encode("Once upon a time there was a girl")
    for how in (1, "all"):
        det, pieces, _ = stream(tok, ids, how, stop=["girl", "a time", "was"])
        assert det.stopped and det.text == "".join(pieces) == "Once upon "


def test_stop_first_completed_wins(tok):
    ids = tok.encode("Once upon a time there was a girl")
    for how in (1, 3, "all"):
        det, _, _ = stream(tok, ids, how, stop=["upon a time", "upon"])
        assert det.text == "Once "
        det, _, _ = stream(tok, ids, how, stop=["a time there", "time"])
        assert det.text == "Once upon a "


def _reference_stop(full, stops):
    """Text before the stop occurrence that ends first (ties: starts first), and whether one occurred."""
    hits = [(i + len(s), i) for s in stops if s for i in (full.find(s),) if i >= 0]
    return (full[: min(hits)[1]], True) if hits else (full, False)


def test_stop_matches_reference_for_any_chunking(tok):
    rng = random.Random(99)
    for _ in range(200):
        text = "".join(rng.choice(SAMPLE_TEXTS[:5] + CJK_EMOJI) for _ in range(rng.randint(1, 4)))
        ids = tok.encode(text)
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.7:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zz", "Once upon a day", "猫猫", "😀😀😀", " and the"]))
        expected, found = _reference_stop(full, stops)
        for how in (1, rng.choice([2, 4]), "random", "all"):
            det, pieces, tail = stream(tok, ids, how, stop=stops, rng=rng)
            assert "".join(pieces) + tail == det.text == expected, (text, stops, how)
            assert det.stopped == found


def test_stop_spanning_tokens(tok):
    ids = tok.encode("Lily and Tom went to the park")
    det = IncrementalDetokenizer(tok, stop=["Tom went to"])
    out, stopped_at = [], None
    for n, i in enumerate(ids):
        out.append(det.add([i]))
        if det.stopped and stopped_at is None:
            stopped_at = n
    assert det.stopped and "".join(out) == det.text == "Lily and "
    # the stop string spans several tokens and is recognised on the token that completes it
    assert "Tom went to" not in tok.decode(ids[:stopped_at]) and "Tom went to" in tok.decode(ids[: stopped_at + 1])
    assert "Tom" in tok.decode(ids[: stopped_at - 1])
    assert det.finish() == ""


def test_stop_at_very_start(tok):
    ids = tok.encode("Once upon a time")
    det, pieces, tail = stream(tok, ids, 1, stop=["Once"])
    assert det.stopped and pieces == [""] * len(ids) and tail == "" and det.text == ""


def test_nothing_after_stop(tok):
    det = IncrementalDetokenizer(tok, stop=["upon"])
    first = det.add(tok.encode("Once upon a time"))
    assert first == "Once " and det.stopped
    assert det.add(tok.encode(" more text")) == ""
    assert det.finish() == "" and det.text == "Once "


def test_stop_in_multibyte_text(tok):
    ids = tok.encode("我喜欢猫和狗")
    for how in (1, 2, "all"):
        det, pieces, tail = stream(tok, ids, how, stop=["猫"])
        assert det.stopped and "".join(pieces) + tail == det.text == "我喜欢"


def test_stop_completed_by_finish(stories_dir):
    llama = Tokenizer.from_folder(stories_dir)
    ids = llama.encode("你好")  # only byte-fallback tokens: held until the run ends
    det = IncrementalDetokenizer(llama, stop=["好"])
    assert [det.add([i]) for i in ids] == [""] * len(ids)
    assert det.finish() == "你" and det.stopped and det.text == "你"


def test_holdback_released_when_match_fails(tok):
    text = "Once upon a time there was a little girl. Once upon a day she ran."
    ids = tok.encode(text)
    stop = ["Once upon a day", "girl!"]
    plain = IncrementalDetokenizer(tok)
    det = IncrementalDetokenizer(tok, stop=stop)
    held_seen = False
    for i in ids:
        plain.add([i])
        det.add([i])
        if det.stopped:
            break
        assert plain.text.startswith(det.text)
        withheld = plain.text[len(det.text) :]
        assert any(s.startswith(withheld) for s in stop)
        held_seen |= bool(withheld)
    assert held_seen and det.stopped
    assert det.text == "Once upon a time there was a little girl. "


def test_no_stop_match_emits_everything(tok):
    ids = tok.encode("Once upon a time there was a girl")
    det, pieces, tail = stream(tok, ids, 1, stop=["a tim!", "girls", "girl!"])
    assert not det.stopped
    assert "".join(pieces) + tail == det.text == tok.decode(ids)
    assert tail == "girl"  # held as a possible start of "girl!", flushed by finish()


def test_argument_errors(tok):
    with pytest.raises(TokenizerError):
        IncrementalDetokenizer(tok, stop="abc")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError):
        IncrementalDetokenizer(tok, stop=[1])  # type: ignore[list-item]
    det = IncrementalDetokenizer(tok, stop=["", "x"])
    with pytest.raises(TokenizerError):
        det.add([-3])
    assert det.add([]) == "" and det.finish() == ""
    with pytest.raises(RuntimeError):
        det.add([5])
    assert det.finish() == ""
