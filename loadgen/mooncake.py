"""Mooncake's FAST'25 request traces (Qin et al., "Mooncake: Trading More Storage for Less
Computation — A KVCache-centric Architecture for Serving LLM Chatbot", FAST 2025; Apache-2.0,
github.com/kvcache-ai/Mooncake, ``FAST25-release/traces``).

One JSON object a line: ``timestamp`` (ms since the trace's start), ``input_length``,
``output_length`` and ``hash_ids``, one id per :data:`BLOCK_TOKENS`-token block of the prompt,
chained on the block before it, so requests whose ``hash_ids`` start alike share that prompt
prefix. The conversation trace's timestamps are quantised into ~3 s buckets; :func:`spread_ties`
spreads the requests of a bucket evenly over it.

Pure standard library; never imports torch or ray.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BLOCK_TOKENS", "CONVERSATION_KEY_BLOCKS", "in_conversation_sample", "read_mooncake_trace", "spread_ties"]

BLOCK_TOKENS = 512  # prompt tokens named by one hash id
CONVERSATION_KEY_BLOCKS = 2  # the leading hash ids that name a request's conversation (see in_conversation_sample)


def in_conversation_sample(hash_ids: Sequence[int], rate: float, seed: int = 0) -> bool:
    """Whether a request belongs to a spatially hashed sample of conversations, at ``rate`` (0, 1].

    The key is the first :data:`CONVERSATION_KEY_BLOCKS` hash ids (the shared system-prompt block
    and the conversation's first own block in the conversation trace): every turn of a kept
    conversation is kept, so prefix reuse inside a conversation survives the cut, where the first
    ``n`` rows of the trace mostly hold first turns. The request is kept when
    ``sha256(seed, key) / 2**256 < rate`` — SHARDS' spatial sampling (Waldspurger et al.,
    "Efficient MRC Construction with SHARDS", FAST 2015), keyed on conversations instead of
    cache keys. ValueError for a rate outside (0, 1].
    """
    if not (0 < rate <= 1):
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    key = f"{seed}:{list(hash_ids[:CONVERSATION_KEY_BLOCKS])}".encode()
    return int.from_bytes(hashlib.sha256(key).digest(), "big") < rate * 2**256


def _count(row: dict, field: str) -> int:
    value = row.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
    return value


def _hash_ids(row: dict, input_tokens: int) -> tuple[int, ...]:
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise ValueError(f"hash_ids must be a list of integers >= 0, got {ids!r}")
    need = math.ceil(input_tokens / BLOCK_TOKENS)
    if len(ids) != need:
        raise ValueError(f"{input_tokens} input tokens need {need} hash_ids of {BLOCK_TOKENS} tokens, got {len(ids)}")
    return tuple(ids)


def spread_ties(times_s: Sequence[float]) -> list[float]:
    """Non-decreasing ``times_s`` (seconds) with every run of equal times spread evenly up to the next
    distinct time.

    The ``k``-th of ``n`` equal times ``t`` (next distinct time ``t'``) becomes
    ``t + k (t' - t) / n``; the last run spreads over the median gap between distinct times (it
    stays put when there is only one distinct time).
    """
    if not times_s:
        return []
    distinct = sorted(set(times_s))
    gaps = [b - a for a, b in zip(distinct, distinct[1:])]
    following = dict(zip(distinct, distinct[1:] + [distinct[-1] + (statistics.median(gaps) if gaps else 0.0)]))
    out: list[float] = []
    for t, run in itertools.groupby(times_s):
        n = len(list(run))
        out += [t + k * (following[t] - t) / n for k in range(n)]
    return out


def read_mooncake_trace(path: Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """``(t_s, input_tokens, output_tokens, hash_ids)`` for every row of a Mooncake trace (JSON
    Lines); ``t_s`` is seconds since the first row, with ties spread (:func:`spread_ties`).

    ValueError (with the file line number) for a line that is not a JSON object, a missing or
    negative count, ``hash_ids`` that are not ``ceil(input_length / 512)`` integers, or a
    timestamp earlier than the one before it.
    """
    parsed: list[tuple[int, int, int, tuple[int, ...]]] = []  # (ms, input, output, hash ids)
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("expected a JSON object")
                ms, inp, out = (_count(row, k) for k in ("timestamp", "input_length", "output_length"))
                ids = _hash_ids(row, inp)
            except ValueError as exc:  # json.JSONDecodeError included
                raise ValueError(f"{path}:{line_no}: malformed row: {exc}") from None
            if parsed and ms < parsed[-1][0]:
                raise ValueError(f"{path}:{line_no}: timestamp {ms} is earlier than the row before it")
            parsed.append((ms, inp, out, ids))
    times = spread_ties([(ms - parsed[0][0]) / 1e3 for ms, *_ in parsed])
    return [(t, inp, out, ids) for t, (_, inp, out, ids) in zip(times, parsed)]
