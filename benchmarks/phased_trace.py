"""A trace whose load changes over time, for comparing fixed placements with ``--placement auto``.

It alternates a decode-heavy phase (short prompts, long outputs: every worker should decode) with a
prompt-heavy one (long prompts, short outputs: prompt chunks stretch the decode steps they share,
which a prefill worker of its own cures). Arrivals are Poisson at 1 request per trace second within
each phase (``pdserve bench --trace FILE --rate R`` rescales them to R on average). The file is in
the Azure trace's CSV format (``TIMESTAMP,ContextTokens,GeneratedTokens``), which ``pdserve bench``
and ``pdserve simulate`` read with ``--trace PATH``. Standard library only.
"""

from __future__ import annotations

import csv
import random
from datetime import datetime, timedelta
from pathlib import Path

# (name, prompt tokens, output tokens) of each phase, in turn
PHASES = (("decode-heavy", 64, 256), ("prompt-heavy", 1024, 16))
START = datetime(2026, 1, 1)


def phased_trace(num_requests: int, rounds: int = 2, seed: int = 0, phases=PHASES) -> list[tuple[float, int, int]]:
    """``(t_s, prompt tokens, output tokens)`` rows: ``rounds`` times each of ``phases``, the
    ``num_requests`` split evenly between the ``rounds * len(phases)`` phases (ValueError when fewer
    than one each)."""
    slots = rounds * len(phases)
    if num_requests < slots:
        raise ValueError(f"a phased trace needs at least {slots} requests, one per phase; got {num_requests}")
    rng, t, rows = random.Random(seed), 0.0, []
    for i in range(slots):
        _, prompt, output = phases[i % len(phases)]
        for _ in range(num_requests // slots + (1 if i < num_requests % slots else 0)):
            t += rng.expovariate(1.0)
            rows.append((t, prompt, output))
    return rows


def write_phased_trace(path: Path, num_requests: int, rounds: int = 2, seed: int = 0) -> Path:
    """Write ``phased_trace`` to ``path`` in the Azure CSV format; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, prompt, output in phased_trace(num_requests, rounds, seed):
            stamp = (START + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
            w.writerow([stamp, prompt, output])
    return path
