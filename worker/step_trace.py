"""Each engine step of a worker as one JSON line, when ``$PDSERVE_STEP_TRACE`` names a folder: what
the step computed and how long it took, to hold against what a profile's step model predicts for
the same step (``benchmarks/step_trace.py``).

A line: ``t0`` and ``t1`` (the step's start and end, ns of the engine's clock), ``cpu_ns`` (the
engine thread's CPU time in the forward: less than ``t1 - t0`` when the thread waited for its core
or the GIL), ``chunks`` (``[tokens, cached before]`` per prompt chunk), ``b`` (decode rows) and
``context`` (the positions the decode rows attend to, in all), as ``StepModel.batch_s`` takes them.
The folder gets one file per worker process, ``steps-<pid>.jsonl``, each line written as its step
ends (a worker may be killed rather than stopped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "PDSERVE_STEP_TRACE"


def trace_file(folder: str | Path, pid: int) -> Path:
    """Where worker process ``pid`` writes its steps in ``folder``."""
    return Path(folder) / f"steps-{pid}.jsonl"


def read_steps(path: Path) -> tuple[list[dict], int]:
    """The steps of one trace file and how many of its lines are no step (a line cut short when its
    worker was killed, anything else): those are skipped. No file: no steps."""
    if not path.exists():
        return [], 0
    steps, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            s = json.loads(line)
            ok = isinstance(s, dict) and s["t1"] > s["t0"] and s["cpu_ns"] >= 0 and s["b"] >= 0
            ok = ok and s["context"] >= 0 and all(n > 0 and c >= 0 for n, c in s["chunks"])
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            steps.append(s)
        elif line.strip():
            bad += 1
    return steps, bad


def step_shape(step: dict) -> tuple[list[tuple[int, int]], int, int]:
    """A traced step's ``(chunks, b, context)``, as ``StepModel.batch_s`` takes them."""
    return [tuple(c) for c in step["chunks"]], step["b"], step["context"]


class StepTrace:
    """``LLMEngine.step_trace`` writing to ``trace_file(folder, pid)`` (OSError when it cannot)."""

    def __init__(self, folder: str | Path) -> None:
        path = trace_file(folder, os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered: a worker may be killed)

    def __call__(self, shape: tuple, t0: int, t1: int, cpu_ns: int) -> None:
        chunks, b, context = shape  # engine.scheduling.batch.batch_shape
        line = {"t0": t0, "t1": t1, "cpu_ns": cpu_ns, "chunks": chunks, "b": b, "context": context}
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")


def attach(engine) -> None:
    """Trace ``engine``'s steps when ``$PDSERVE_STEP_TRACE`` is set."""
    folder = os.environ.get(ENV)
    if folder:
        try:
            engine.step_trace = StepTrace(folder)
        except OSError as exc:
            raise OSError(f"${ENV}={folder}: cannot write the step trace there: {exc}") from exc
