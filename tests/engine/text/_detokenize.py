"""Streaming a token list through IncrementalDetokenizer in chunks of a chosen size, and texts whose
characters span several byte-level tokens."""

from __future__ import annotations

import random

from pdserve.engine.text.detokenizer import IncrementalDetokenizer

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
