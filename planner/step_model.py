"""The step-time model fitted to a profile (``pdserve profile``): how long a prefill step, a decode
step, a mixed step and a KV hand-off take on the machine, model and dtype that were measured.

In seconds, for a step that computes prompt chunks of ``n`` uncached tokens after ``c`` cached
prefix tokens, or decodes ``b`` sequences whose contexts add up to ``T`` tokens, and a hand-off of
``B`` KV bytes:

- ``prefill_s(n, c) = p0 + p1*n + p2*n*(n/2 + c) + p3*n^2``: a cost per step, the linear layers
  per token, causal attention (each new token attends to the prefix and, on average, half the
  chunk), and the rise of the cost per token with the step's size: past some size a step's
  activations (``n`` rows of the widest layer) no longer fit the caches, and every layer streams
  them from memory (the embedded model's MLP on a 2-core EPYC: 4.3 us a token and layer up to 1024
  tokens, 7.7 us at 2048); ``p3*n^2`` is the smooth stand-in for that rise (0 where nothing
  spills). A step of several prompts (``batch_s``) pays ``p0`` once, ``p1`` and ``p3`` on the
  tokens of all of them (they go through the layers as one packed batch) and the attention of each
  (each attends to itself only). The profile measures such steps beside single prompts and cached
  prefixes, which also tell the two quadratic terms apart;
- ``decode_s(b, T) = d0 + d1*b + d2*T``: the weights read once per step, a cost per row, the KV read;
- ``mixed_s(n, c, b, T) = prefill_s(n, c) + m1*b + m2*T``: a chunked-prefill step is a prefill step
  (one per-step cost, ``p0``) whose decode rows are query rows of one token each: ``m1`` per row
  (its pass through the layers, its logits and sampled token, its bookkeeping) and ``m2`` per
  position it attends to. They are not ``d1`` and ``d2``: the rows take the prefill path, where
  the attention kernel reads their K/V as one-row tiles of a packed batch, without the decode
  path's prefetch of the next KV blocks, so a context token costs more than in a decode step (a
  row with 1024-1900 tokens of context: 1.3-1.6x its time in a decode step, on a 2-core EPYC).
  ``m1`` and ``m2`` are fitted to the mixed points (less ``prefill_s`` of their prompts), which
  span two decode contexts so that the two separate. A step never takes less than
  ``decode_s(b, T)``, the decode step of its rows alone, so a prompt joining decode rows never
  makes a step faster;
- ``handoff_s(B) = h0 + B / h1``: read out of the cache, serialise, stream over gRPC, decode and
  write into the receiver's cache.

The coefficients are non-negative (none of these costs can be negative), so every prediction grows
with every argument. They are fitted by least squares on relative error (each point's row divided
by its time), so a 5 ms step counts as much as a 2 s one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

SCHEMA = 2  # the layout of the profile JSON; from_profile reads only this one (1: the mixed step not fitted)
MAX_STEP_S = 86400.0  # a profile whose coefficients predict a step longer than a day is refused
SECTIONS = ("prefill", "decode", "mixed", "handoff")  # of both ``points`` and ``fits``
UNITS = {
    "prefill": {"p0": "s", "p1": "s/token", "p2": "s/token^2", "p3": "s/token^2"},
    "decode": {"d0": "s", "d1": "s/sequence", "d2": "s/context token"},
    "mixed": {"m1": "s/sequence", "m2": "s/context token"},
    "handoff": {"h0": "s", "h1": "bytes/s"},
}
FORMULAS = {
    "prefill": "p0 + p1*n + p2*n*(n/2 + c) + p3*n^2; over a step's prompts: p1, p3 on all their tokens, p2 summed",
    "decode": "d0 + d1*b + d2*T",
    "mixed": "prefill_s(n, c) + m1*b + m2*T",
    "handoff": "h0 + bytes / h1",
}


@dataclass(frozen=True)
class StepModel:
    """Fitted coefficients (see the module docstring for the forms); seconds, tokens and bytes.
    ``h1`` is the hand-off's bytes per second (``math.inf`` when the fit found no cost per byte)."""

    p0: float
    p1: float
    p2: float
    p3: float
    d0: float
    d1: float
    d2: float
    m1: float
    m2: float
    h0: float
    h1: float

    def prefill_s(self, n: float, c: float = 0) -> float:
        """Seconds of a step computing ``n`` prompt tokens after a cached prefix of ``c`` tokens."""
        return self.p0 + self.p1 * n + self.p2 * n * (n / 2 + c) + self.p3 * n * n

    def decode_s(self, b: float, total_context: float) -> float:
        """Seconds of a step decoding ``b`` sequences whose contexts add up to ``total_context``
        tokens (``b * L`` for ``b`` sequences of ``L`` tokens)."""
        return self.d0 + self.d1 * b + self.d2 * total_context

    def mixed_s(self, n: float, c: float, b: float, total_context: float) -> float:
        """Seconds of a chunked-prefill step: ``n`` prompt tokens after ``c`` cached ones beside ``b``
        decoding sequences of ``total_context`` tokens in all; a pure prefill or decode step when
        ``b`` or ``n`` is 0."""
        return self.batch_s([(n, c)] if n > 0 else [], b, total_context)

    def batch_s(self, chunks: list[tuple[int, int]], b: int, total_context: float) -> float:
        """Seconds of an engine step computing prompt ``chunks`` (``(n, c)``: ``n`` tokens after ``c``
        already in the cache, one per sequence) beside ``b`` decoding sequences of ``total_context``
        tokens in all: ``prefill_s`` with the tokens and the attention summed over the chunks, plus
        ``m1`` and ``m2`` for the decode rows, and never less than the decode step of those rows
        alone (``decode_s``, what the step is when there is no chunk)."""
        n = sum(q for q, _ in chunks)
        if b > 0 and n <= 0:
            return self.decode_s(b, total_context)
        pre = self.p0 + self.p1 * n + self.p2 * sum(q * (q / 2 + c) for q, c in chunks) + self.p3 * n * n
        if b <= 0:
            return pre
        return max(pre + self.m1 * b + self.m2 * total_context, self.decode_s(b, total_context))

    def handoff_s(self, nbytes: float) -> float:
        """Seconds to hand ``nbytes`` of KV from a prefill engine's cache to a decode engine's."""
        return self.h0 + nbytes / self.h1

    @classmethod
    def from_profile(cls, profile: dict) -> StepModel:
        """The model stored in a profile's ``fits``. ValueError when the profile is of another
        ``schema`` or lacks a section or a coefficient."""
        if not isinstance(profile, dict):
            raise ValueError(f"a profile is a JSON object, got {type(profile).__name__}")
        if profile.get("schema") != SCHEMA:
            raise ValueError(
                f"profile schema {profile.get('schema')!r}; this pdserve reads schema {SCHEMA} "
                "(run pdserve profile again to write one)"
            )
        for key in ("machine", "points", "fits"):
            if not isinstance(profile.get(key), dict):
                raise ValueError(f"profile has no {key!r} section")
        values = {}
        for section, units in UNITS.items():
            fit = profile["fits"].get(section)
            if not isinstance(fit, dict) or not isinstance(fit.get("coefficients"), dict):
                raise ValueError(f"profile has no fits.{section} section")
            for name in units:
                coef = fit["coefficients"].get(name)
                if not isinstance(coef, dict) or "value" not in coef:
                    raise ValueError(f"profile has no coefficient fits.{section}.coefficients.{name}")
                values[name] = coef["value"]
        values["h1"] = math.inf if values["h1"] is None else values["h1"]
        for name, v in values.items():
            if not isinstance(v, (int, float)) or not (v > 0 if name == "h1" else v >= 0) or math.isnan(v):
                bound = "> 0" if name == "h1" else ">= 0"
                raise ValueError(f"profile coefficient {name} must be a number {bound}, got {v!r}")
        model = cls(**{k: float(v) for k, v in values.items()})
        probe = {  # a large step of each kind: beyond MAX_STEP_S no machine measured these coefficients
            "a prefill step of 4096 tokens": model.prefill_s(4096, 4096),
            "a decode step of 256 rows": model.decode_s(256, 256 * 4096),
            "a mixed step": model.mixed_s(4096, 4096, 256, 256 * 4096),
            "a 1 GB KV hand-off": model.handoff_s(1e9),
        }
        for what, seconds in probe.items():
            if not seconds < MAX_STEP_S:
                raise ValueError(
                    f"profile coefficients predict {seconds:.3g} s for {what}, over {MAX_STEP_S:g} s: no machine "
                    "measures that; run pdserve profile again"
                )
        return model


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min |a x - y|, x >= 0``, exactly, by trying every subset of
    columns (the models here have at most four)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x_sub = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            err = float(np.sum((a @ x - y) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def fit_relative(features: list[list[float]], seconds: list[float], known: list[float] | None = None) -> list[float]:
    """Non-negative coefficients minimising the squared relative error over the points, of the
    part of each point's seconds not already ``known`` (another fit's share of it; none when None)."""
    a, y = np.asarray(features, dtype=float), np.asarray(seconds, dtype=float)
    if len(y) < a.shape[1]:
        raise ValueError(f"{len(y)} points cannot determine {a.shape[1]} coefficients")
    if np.any(y <= 0):
        raise ValueError("every measured time must be > 0")
    rest = y if known is None else y - np.asarray(known, dtype=float)
    return [float(v) for v in nnls(a / y[:, None], rest / y)]


def error_stats(predicted: list[float], seconds: list[float]) -> dict:
    """``max_rel`` and ``median_rel``: |predicted - measured| / measured over the ``points``."""
    rel = [abs(p - s) / s for p, s in zip(predicted, seconds)]
    return {"max_rel": max(rel), "median_rel": float(np.median(rel)), "points": len(rel)}


def fit_profile(points: dict) -> dict:
    """The ``fits`` section for the ``points`` of a profile (keys as ``pdserve profile`` writes
    them): for each section its formula, coefficients (``{"value", "unit"}``) and error on its own
    points. ValueError when a section has too few points to fit; with fewer than 2 mixed points,
    the decode rows of a mixed step are taken to cost what they cost in a decode step (``d1``, ``d2``)."""
    pre, dec, mix, hand = (points[s] for s in SECTIONS)
    p = fit_relative([[1, _n(q), q["prompts"] * _pairs(q), _n(q) ** 2] for q in pre], _s(pre))
    d = fit_relative([[1, q["batch"], q["total_context"]] for q in dec], _s(dec))
    h0, per_byte = fit_relative([[1, q["bytes"]] for q in hand], _s(hand))
    model = StepModel(*p, *d, m1=d[1], m2=d[2], h0=h0, h1=1 / per_byte if per_byte > 0 else math.inf)
    if len(mix) >= 2:  # the decode rows' share of each mixed point: what its prompt chunk leaves
        chunk = [model.prefill_s(q["prompt_tokens"], q["cached_tokens"]) for q in mix]
        m1, m2 = fit_relative([[q["batch"], q["total_context"]] for q in mix], _s(mix), chunk)
        model = replace(model, m1=m1, m2=m2)
    predicted = {
        "prefill": [model.batch_s([(q["tokens"], q["cached_tokens"])] * q["prompts"], 0, 0) for q in pre],
        "decode": [model.decode_s(q["batch"], q["total_context"]) for q in dec],
        "mixed": [model.mixed_s(q["prompt_tokens"], q["cached_tokens"], q["batch"], q["total_context"]) for q in mix],
        "handoff": [model.handoff_s(q["bytes"]) for q in hand],
    }
    values = {
        "prefill": dict(zip(("p0", "p1", "p2", "p3"), p)),
        "decode": dict(zip(("d0", "d1", "d2"), d)),
        "mixed": {"m1": model.m1, "m2": model.m2},
        "handoff": {"h0": h0, "h1": model.h1 if math.isfinite(model.h1) else None},
    }
    return {
        s: {
            "formula": FORMULAS[s],
            "coefficients": {k: {"value": v, "unit": UNITS[s][k]} for k, v in values[s].items()},
            "error": error_stats(predicted[s], _s(points[s])) if points[s] else None,
        }
        for s in SECTIONS
    }


def _n(q: dict) -> int:
    """Prompt tokens of a prefill point's step, all its prompts together."""
    return q["prompts"] * q["tokens"]


def _pairs(q: dict) -> float:
    """Query-key pairs of one prompt of a prefill point: ``n*(n/2 + c)``."""
    return q["tokens"] * (q["tokens"] / 2 + q["cached_tokens"])


def _s(rows: list[dict]) -> list[float]:
    return [q["seconds"] for q in rows]
