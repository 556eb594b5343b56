"""The prompt sets the load generator reads from the shared datasets folder, as lists of texts.

Each entry of :data:`PROMPT_SETS` names one prompt set and reads its file (see
``../shared/datasets/README.md`` and each folder's ``SOURCE.md``), returning the first user turn of
every row: ShareGPT, Arena-Hard, MT-Bench, Vicuna bench, BELLE eval, MT-Bench-ZH, Arena-Hard zh and
HumanEval. :func:`load_prompts` reads several sets as (set name, text) pairs for
:class:`pdserve.loadgen.prompts.PromptPool`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.loadgen.dataset_files import dataset_file

__all__ = ["PROMPT_SETS", "load_prompts"]


def _json_lines(path: Path) -> Iterable[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            yield row


def _texts(values: Iterable[Any]) -> list[str]:
    """Non-empty strings among ``values`` (others, e.g. a missing field, are skipped)."""
    return [v for v in values if isinstance(v, str) and v.strip()]


def _field(relative: str, key: str) -> Callable[..., list[str]]:
    def load(datasets_dir: str | Path | None = None) -> list[str]:
        return _texts(row.get(key) for row in _json_lines(dataset_file(relative, datasets_dir)))

    return load


def _first_turn(relative: str) -> Callable[..., list[str]]:
    def load(datasets_dir: str | Path | None = None) -> list[str]:
        rows = _json_lines(dataset_file(relative, datasets_dir))
        return _texts(row["turns"][0] for row in rows if isinstance(row.get("turns"), list) and row["turns"])

    return load


def _sharegpt(datasets_dir: str | Path | None = None) -> list[str]:
    """First human turn of each conversation (one JSON array of ``{id, conversations}``)."""
    path = dataset_file("sharegpt_v3_500/ShareGPT_V3_filtered_500.json", datasets_dir)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of conversations")
    firsts = (
        next(
            (t.get("value") for t in row.get("conversations", []) if isinstance(t, dict) and t.get("from") == "human"),
            None,
        )
        for row in data
        if isinstance(row, dict)
    )
    return _texts(firsts)


def _arena_hard(datasets_dir: str | Path | None = None) -> list[str]:
    """Arena-Hard v0.1 and v2.0 prompts (the zh subset is part of v2.0, so not added again)."""
    return _field("arena_hard/arena-hard-v0.1_question.jsonl", "prompt")(datasets_dir) + _field(
        "arena_hard/arena-hard-v2.0_question.jsonl", "prompt"
    )(datasets_dir)


PROMPT_SETS: dict[str, Callable[..., list[str]]] = {
    "sharegpt": _sharegpt,
    "arena-hard": _arena_hard,
    "mt-bench": _first_turn("mt_bench/question.jsonl"),
    "vicuna": _first_turn("vicuna_bench/question.jsonl"),
    "belle-zh": _field("belle_eval_zh/eval_set.json", "question"),  # JSON Lines despite the name
    "mt-bench-zh": _first_turn("mt_bench_zh/question.jsonl"),
    "arena-hard-zh": _field("arena_hard/arena-hard-v2.0_zh_subset.jsonl", "prompt"),
    "humaneval": _field("humaneval/HumanEval.jsonl.gz", "prompt"),
}


def load_prompts(names: Sequence[str], datasets_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(set name, text) for every prompt of the named sets, in order; a repeated name is read once.

    ValueError for an empty list or an unknown name (listing the valid ones);
    FileNotFoundError when a set's file is absent.
    """
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in PROMPT_SETS]
    if unknown or not names:
        raise ValueError(f"unknown prompt set(s) {unknown or list(names)}; valid: {', '.join(PROMPT_SETS)}")
    out: list[tuple[str, str]] = []
    for name in dict.fromkeys(names):
        out += [(name, text) for text in PROMPT_SETS[name](datasets_dir)]
    return out
