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


class StepTrace:
    """``LLMEngine.step_trace`` writing to ``folder/steps-<pid>.jsonl`` (OSError when it cannot)."""

    def __init__(self, folder: str | Path) -> None:
        path = Path(folder) / f"steps-{os.getpid()}.jsonl"
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
