"""The Azure LLM inference trace 2023 (``AzureLLMInferenceTrace_{conv,code}.csv``): one request a
row, ``TIMESTAMP,ContextTokens,GeneratedTokens``, wall-clock times with 7 fractional digits.

Pure standard library; never imports torch or ray.
"""

from __future__ import annotations

import csv
import functools
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["read_azure_trace"]

_AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
_TICKS = 10**9  # timestamps are kept as integer nanoseconds until the final subtraction


@functools.lru_cache(maxsize=4096)
def _whole_seconds(text: str) -> int:
    return int(datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp())


def _parse_timestamp(text: str) -> int:
    """Wall-clock text ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (no time zone) -> integer nanoseconds."""
    whole, _, frac = text.strip().partition(".")
    if frac and not (frac.isdigit() and len(frac) <= 9):
        raise ValueError(f"bad fractional seconds {frac!r}")
    return _whole_seconds(whole) * _TICKS + (int(frac.ljust(9, "0")) if frac else 0)


def _count(text: str, field: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {value}")
    return value


def read_azure_trace(path: Path) -> list[tuple[float, int, int]]:
    """``(t_s, input_tokens, output_tokens)`` for every row of an Azure-format trace CSV; ``t_s`` is
    seconds since the first row, exact to the file's 7 fractional digits.

    ValueError (with the file line number) on a wrong header, a malformed row or a timestamp
    earlier than the one before it.
    """
    ticks: list[int] = []
    lengths: list[tuple[int, int]] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != _AZURE_HEADER:
            raise ValueError(f"{path}:1: expected header {','.join(_AZURE_HEADER)}, got {header}")
        for row in reader:
            line = reader.line_num
            if not row:
                continue
            try:
                if len(row) != 3:
                    raise ValueError(f"expected 3 fields, got {len(row)}")
                tick = _parse_timestamp(row[0])
                lengths.append((_count(row[1], "ContextTokens"), _count(row[2], "GeneratedTokens")))
            except ValueError as exc:
                raise ValueError(f"{path}:{line}: malformed row {row!r}: {exc}") from None
            if ticks and tick < ticks[-1]:
                raise ValueError(f"{path}:{line}: timestamp {row[0]!r} is earlier than the row before it")
            ticks.append(tick)
    return [((tick - ticks[0]) / _TICKS, inp, out) for tick, (inp, out) in zip(ticks, lengths)]
