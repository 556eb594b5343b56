"""The step-time model fitted to a profile (``pdserve profile``): how long a prefill step, a decode
step, a mixed step and a KV hand-off take on the machine, model and dtype that were measured.

In seconds, for a step that computes ``n`` uncached prompt tokens after ``c`` cached prefix tokens,
or decodes ``b`` sequences whose contexts add up to ``T`` tokens, and a hand-off of ``B`` KV bytes:

- ``prefill_s(n, c) = p0 + p1*n + p2*n*(n/2 + c)``: a cost per step, the linear layers per token,
  and causal attention (each new token attends to the prefix and, on average, half the chunk);
- ``decode_s(b, T) = d0 + d1*b + d2*T``: the weights read once per step, a cost per row, the KV read;
- ``mixed_s(n, c, b, T) = prefill_s(n, c) + decode_s(b, T) - min(p0, d0)``: a chunked-prefill step
  pays one per-step cost, not two (the smaller one is taken off, so the sum errs long);
- ``handoff_s(B) = h0 + B / h1``: read out of the cache, serialise, stream over gRPC, decode and
  write into the receiver's cache.

The coefficients are non-negative (none of these costs can be negative), so every prediction grows
with every argument. They are fitted by least squares on relative error (each point's row divided
by its time), so a 5 ms step counts as much as a 2 s one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

SCHEMA = 1  # the layout of the profile JSON; from_profile reads only this one
SECTIONS = ("prefill", "decode", "mixed", "handoff")  # of both ``points`` and ``fits``
UNITS = {
    "prefill": {"p0": "s", "p1": "s/token", "p2": "s/token^2"},
    "decode": {"d0": "s", "d1": "s/sequence", "d2": "s/context token"},
    "mixed": {"fixed_s": "s"},
    "handoff": {"h0": "s", "h1": "bytes/s"},
}
FORMULAS = {
    "prefill": "p0 + p1*n + p2*n*(n/2 + c)",
    "decode": "d0 + d1*b + d2*T",
    "mixed": "prefill_s(n, c) + decode_s(b, T) - fixed_s, fixed_s = min(p0, d0)",
    "handoff": "h0 + bytes / h1",
}


@dataclass(frozen=True)
class StepModel:
    """Fitted coefficients (see the module docstring for the forms); seconds, tokens and bytes.
    ``h1`` is the hand-off's bytes per second (``math.inf`` when the fit found no cost per byte)."""

    p0: float
    p1: float
    p2: float
    d0: float
    d1: float
    d2: float
    h0: float
    h1: float

    @property
    def mixed_fixed_s(self) -> float:
        """The per-step cost a mixed step does not pay twice: ``min(p0, d0)``, seconds."""
        return min(self.p0, self.d0)

    def prefill_s(self, n: float, c: float = 0) -> float:
        """Seconds of a step computing ``n`` prompt tokens after a cached prefix of ``c`` tokens."""
        return self.p0 + self.p1 * n + self.p2 * n * (n / 2 + c)

    def decode_s(self, b: float, total_context: float) -> float:
        """Seconds of a step decoding ``b`` sequences whose contexts add up to ``total_context``
        tokens (``b * L`` for ``b`` sequences of ``L`` tokens)."""
        return self.d0 + self.d1 * b + self.d2 * total_context

    def mixed_s(self, n: float, c: float, b: float, total_context: float) -> float:
        """Seconds of a chunked-prefill step: ``n`` prompt tokens after ``c`` cached ones beside ``b``
        decoding sequences of ``total_context`` tokens in all; a pure prefill or decode step when
        ``b`` or ``n`` is 0."""
        if b <= 0:
            return self.prefill_s(n, c)
        if n <= 0:
            return self.decode_s(b, total_context)
        return self.prefill_s(n, c) + self.decode_s(b, total_context) - self.mixed_fixed_s

    def batch_s(self, chunks: list[tuple[int, int]], b: int, total_context: float) -> float:
        """Seconds of an engine step computing prompt ``chunks`` (``(n, c)``: ``n`` tokens after ``c``
        already in the cache, one per sequence) beside ``b`` decoding sequences of ``total_context``
        tokens in all: ``mixed_s`` with the attention term summed over the chunks."""
        n = sum(q for q, _ in chunks)
        if b > 0 and n <= 0:
            return self.decode_s(b, total_context)
        pre = self.p0 + self.p1 * n + self.p2 * sum(q * (q / 2 + c) for q, c in chunks)
        return pre + self.decode_s(b, total_context) - self.mixed_fixed_s if b > 0 else pre

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
            raise ValueError(f"profile schema {profile.get('schema')!r}; this pdserve reads schema {SCHEMA}")
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
        del values["fixed_s"]  # derived from p0 and d0
        values["h1"] = math.inf if values["h1"] is None else values["h1"]
        return cls(**{k: float(v) for k, v in values.items()})


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min |a x - y|, x >= 0``, exactly, by trying every subset of
    columns (the models here have at most three)."""
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


def fit_relative(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative coefficients minimising the squared relative error over the points."""
    a, y = np.asarray(features, dtype=float), np.asarray(seconds, dtype=float)
    if len(y) < a.shape[1]:
        raise ValueError(f"{len(y)} points cannot determine {a.shape[1]} coefficients")
    if np.any(y <= 0):
        raise ValueError("every measured time must be > 0")
    return [float(v) for v in nnls(a / y[:, None], np.ones_like(y))]


def error_stats(predicted: list[float], seconds: list[float]) -> dict:
    """``max_rel`` and ``median_rel``: |predicted - measured| / measured over the ``points``."""
    rel = [abs(p - s) / s for p, s in zip(predicted, seconds)]
    return {"max_rel": max(rel), "median_rel": float(np.median(rel)), "points": len(rel)}


def fit_profile(points: dict) -> dict:
    """The ``fits`` section for the ``points`` of a profile (keys as ``pdserve profile`` writes
    them): for each section its formula, coefficients (``{"value", "unit"}``) and error on its own
    points. ValueError when a section has too few points to fit."""
    pre, dec, mix, hand = (points[s] for s in SECTIONS)
    p = fit_relative([[1, q["tokens"], q["tokens"] * (q["tokens"] / 2 + q["cached_tokens"])] for q in pre], _s(pre))
    d = fit_relative([[1, q["batch"], q["total_context"]] for q in dec], _s(dec))
    h0, per_byte = fit_relative([[1, q["bytes"]] for q in hand], _s(hand))
    model = StepModel(*p, *d, h0, 1 / per_byte if per_byte > 0 else math.inf)
    predicted = {
        "prefill": [model.prefill_s(q["tokens"], q["cached_tokens"]) for q in pre],
        "decode": [model.decode_s(q["batch"], q["total_context"]) for q in dec],
        "mixed": [model.mixed_s(q["prompt_tokens"], q["cached_tokens"], q["batch"], q["total_context"]) for q in mix],
        "handoff": [model.handoff_s(q["bytes"]) for q in hand],
    }
    values = {
        "prefill": dict(zip(("p0", "p1", "p2"), p)),
        "decode": dict(zip(("d0", "d1", "d2"), d)),
        "mixed": {"fixed_s": model.mixed_fixed_s},
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


def _s(rows: list[dict]) -> list[float]:
    return [q["seconds"] for q in rows]
