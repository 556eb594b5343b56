"""pdserve.engine.text.detokenizer: stop strings end the text where a one-shot decode would, and the
arguments are checked."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.tokenizer import Tokenizer, TokenizerError
from tests.engine.text._detokenize import CJK_EMOJI, stream
from tests.engine.text._tokenizers import SAMPLE_TEXTS


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
