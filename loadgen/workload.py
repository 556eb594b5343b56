"""Workload shapes for load tests: arrival schedules and (input, output) lengths.

Arrivals come either from a production trace (the Azure LLM inference trace 2023, Mooncake's
FAST'25 traces) replayed as recorded, windowed and optionally time-scaled to a target rate, or
from a seeded synthetic process (Poisson, or gamma gaps with vLLM-style "burstiness").  Lengths
come from the same trace rows, clipped to what the model can hold; Mooncake rows also name their
prompt blocks.  :func:`build_workload` joins a schedule and lengths with prompt token ids from a
:class:`pdserve.loadgen.prompts.PromptPool` into :class:`RequestSpec` objects.

Pure standard library + numpy; never imports torch or ray.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.loadgen.azure import read_azure_trace
from pdserve.loadgen.dataset_files import dataset_file
from pdserve.loadgen.mooncake import in_conversation_sample, read_mooncake_trace

if TYPE_CHECKING:
    from pdserve.loadgen.prompts import BlockPrompts, PromptPool

__all__ = [
    "TraceRow",
    "TRACES",
    "RequestSpec",
    "load_trace",
    "window",
    "scale_to_rate",
    "poisson_arrivals",
    "gamma_arrivals",
    "clip_lengths",
    "sample_rows",
    "fix_lengths",
    "build_workload",
]

TRACES = {
    "azure-conv": "azure_llm_trace_2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure_llm_trace_2023/AzureLLMInferenceTrace_code.csv",
    "mooncake-conversation": "mooncake_fast25_traces/conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_fast25_traces/synthetic_trace.jsonl",
}


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds since the trace's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per 512-token prompt block, chained on the one before


@dataclass(frozen=True)
class RequestSpec:
    index: int
    send_at_s: float  # seconds after the run starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output length to hold; sent with ignore_eos so exactly this many come back
    prompt_source: str  # prompt-set name the text came from


def load_trace(name_or_path: str, datasets_dir: str | Path | None = None) -> list[TraceRow]:
    """Rows of an Azure-format trace CSV (:func:`pdserve.loadgen.azure.read_azure_trace`) or, for a
    ``.jsonl`` file, of a Mooncake trace with its hash ids (:func:`pdserve.loadgen.mooncake.read_mooncake_trace`).

    ``name_or_path`` is a key of :data:`TRACES` (resolved under the datasets folder,
    :mod:`pdserve.loadgen.dataset_files`)
    or a path to such a file.  Times are seconds relative to the first row.  Raises
    FileNotFoundError when the file is absent and ValueError (with the file line number) on a
    malformed file.
    """
    if name_or_path in TRACES:
        path = dataset_file(TRACES[name_or_path], datasets_dir)
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"trace {name_or_path!r} is neither a file nor one of {sorted(TRACES)}; "
                f"point at the datasets folder with --datasets-dir"
            )
    read = read_mooncake_trace if path.suffix == ".jsonl" else read_azure_trace
    return [TraceRow(*row) for row in read(path)]


def window(
    rows: Sequence[TraceRow], start_s: float = 0.0, duration_s: float | None = None, max_requests: int | None = None
) -> list[TraceRow]:
    """Rows with ``start_s <= t < start_s + duration_s``, re-based so the first kept row is at t=0,
    then cut to the first ``max_requests``.  ``duration_s=None`` means to the end of the trace."""
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    end = math.inf if duration_s is None else start_s + duration_s
    kept = [r for r in rows if start_s <= r.t_s < end]
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        return []
    t0 = kept[0].t_s
    return [replace(r, t_s=r.t_s - t0) for r in kept]


def sample_conversations(rows: Sequence[TraceRow], rate: float | None, seed: int = 0) -> list[TraceRow]:
    """The rows of a sample of conversations (:func:`pdserve.loadgen.mooncake.in_conversation_sample`),
    their times kept; all of ``rows`` for ``rate=None``. ValueError for a rate outside (0, 1] or
    rows without hash ids (only Mooncake traces name conversations)."""
    if rate is None:
        return list(rows)
    if rows and not all(r.hash_ids for r in rows):
        raise ValueError("--conversation-sample needs a trace with hash ids (a Mooncake trace)")
    return [r for r in rows if in_conversation_sample(r.hash_ids, rate, seed)]


def scale_to_rate(rows: Sequence[TraceRow], target_rate: float) -> list[TraceRow]:
    """Multiply every time by one factor so that (n-1)/(last-first) equals ``target_rate`` (req/s).

    Relative spacing (ratios of gaps) is kept.  ValueError for a non-positive or
    non-finite rate, fewer than 2 rows, or rows that all share one time.
    """
    if not (math.isfinite(target_rate) and target_rate > 0):
        raise ValueError(f"target_rate must be a positive number, got {target_rate}")
    if len(rows) < 2:
        raise ValueError(f"need at least 2 rows to define a rate, got {len(rows)}")
    span = rows[-1].t_s - rows[0].t_s
    if span <= 0:
        raise ValueError("rows span zero seconds; their rate is undefined")
    factor = (len(rows) - 1) / (target_rate * span)
    return [replace(r, t_s=r.t_s * factor) for r in rows]


def _check_rate(rate: float, n: int) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number, got {rate}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def _cumulative(gaps: np.ndarray) -> list[float]:
    return [0.0] + np.cumsum(gaps).tolist()


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` send times of a Poisson process of ``rate`` req/s: exponential gaps, the first at 0."""
    _check_rate(rate, n)
    if n == 0:
        return []
    return _cumulative(np.random.default_rng(seed).exponential(1.0 / rate, n - 1))


def gamma_arrivals(rate: float, n: int, burstiness: float, seed: int) -> list[float]:
    """``n`` send times with gamma gaps (shape ``burstiness``, scale 1/(rate*burstiness)), the first at 0.

    The mean gap is 1/rate whatever the burstiness; the gaps' CV is
    1/sqrt(burstiness): 1 is Poisson, < 1 burstier, > 1 more regular (vLLM's
    benchmark "burstiness").
    """
    _check_rate(rate, n)
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if n == 0:
        return []
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n - 1)
    return _cumulative(gaps)


def clip_lengths(
    input_tokens: int,
    output_tokens: int,
    max_model_len: int,
    length_scale: float = 1.0,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> tuple[int, int]:
    """(input, output) lengths that fit the model.

    Both are scaled by ``length_scale`` (Python ``round``, at least 1), capped by
    ``max_input_tokens`` / ``max_output_tokens``, and then, while input + output
    exceeds ``max_model_len``, the input is trimmed first (down to 1 token) and
    then the output (down to 1).  ValueError for max_model_len < 2, a
    non-positive scale or a cap < 1.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (one prompt and one output token), got {max_model_len}")
    if not (math.isfinite(length_scale) and length_scale > 0):
        raise ValueError(f"length_scale must be a positive number, got {length_scale}")
    for name, cap in (("max_input_tokens", max_input_tokens), ("max_output_tokens", max_output_tokens)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1, got {cap}")
    inp = max(1, round(input_tokens * length_scale))
    out = max(1, round(output_tokens * length_scale))
    if max_input_tokens is not None:
        inp = min(inp, max_input_tokens)
    if max_output_tokens is not None:
        out = min(out, max_output_tokens)
    inp = max(1, min(inp, max_model_len - out))
    out = min(out, max_model_len - inp)
    return inp, out


def sample_rows(rows: Sequence[TraceRow], n: int, seed: int) -> list[TraceRow]:
    """``n`` trace rows drawn with replacement (their lengths and hash ids, for synthetic arrivals)."""
    if not rows:
        raise ValueError("need at least one trace row to sample lengths from")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return random.Random(seed).choices(rows, k=n)


def fix_lengths(
    lengths: Sequence[tuple[int, int]], max_model_len: int, input_len: int | None = None, output_len: int | None = None
) -> list[tuple[int, int]]:
    """``lengths`` with the input and/or the output replaced by a fixed count, kept exact.

    A side without a fixed count keeps its (already clipped) length, trimmed (down to 1) so the
    pair fits ``max_model_len``. ValueError for a fixed count < 1 or fixed counts that do not fit.
    """
    for name, value in (("input_len", input_len), ("output_len", output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    need = (input_len or 1) + (output_len or 1)
    if need > max_model_len:
        raise ValueError(
            f"fixed lengths (input {input_len}, output {output_len}) need {need} tokens, "
            f"more than the model's {max_model_len}"
        )
    out = []
    for inp, outp in lengths:
        if input_len is not None:
            inp = input_len
        if output_len is not None:
            outp = output_len
        if input_len is None:
            inp = max(1, min(inp, max_model_len - outp))
        if output_len is None:
            outp = max(1, min(outp, max_model_len - inp))
        out.append((inp, outp))
    return out


def build_workload(
    arrivals: Sequence[float],
    lengths: Sequence[tuple[int, int]],
    prompts: PromptPool | BlockPrompts,
    seed: int,
    hash_ids: Sequence[Sequence[int]] | None = None,
) -> list[RequestSpec]:
    """Zip send times with (input, output) lengths; each prompt is exactly ``input`` ids from ``prompts``.

    With ``hash_ids`` (one sequence per request, from a Mooncake trace) ``prompts`` is a
    :class:`~pdserve.loadgen.prompts.BlockPrompts` and each prompt is built from its request's ids,
    so requests whose ids start alike share that prompt prefix.  Deterministic for a seed.
    ValueError when the sequences differ in length, when arrivals decrease or are negative, or
    when a length is < 1.
    """
    if len(arrivals) != len(lengths):
        raise ValueError(f"{len(arrivals)} arrivals but {len(lengths)} lengths")
    if hash_ids is not None and len(hash_ids) != len(lengths):
        raise ValueError(f"{len(lengths)} lengths but {len(hash_ids)} hash id sequences")
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    prev = 0.0
    for i, (t, (inp, out)) in enumerate(zip(arrivals, lengths)):
        if not (math.isfinite(t) and t >= prev):
            raise ValueError(f"arrival {i} at {t} s is negative or earlier than the one before it")
        if inp < 1 or out < 1:
            raise ValueError(f"request {i}: input and output lengths must be >= 1, got ({inp}, {out})")
        ids, source = prompts.make(inp, rng) if hash_ids is None else prompts.make(hash_ids[i], inp, rng)
        specs.append(RequestSpec(i, float(t), ids, int(out), source))
        prev = t
    return specs
