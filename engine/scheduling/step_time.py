"""An online model of how long a step takes, so a colocated scheduler can size prefill chunks to an
inter-token latency target instead of a fixed token count.

A step that decodes ``d`` sequences and computes ``p`` prompt tokens takes about
``a + c * d + b * p`` seconds (the weights read once per step, a per-row decode cost with its KV
read, a per-token prefill cost). The three coefficients are fitted by exponentially weighted least
squares over recent steps, so the fit follows the hardware it runs on: the same chunk costs about
ten times more on a CPU core without bfloat16 matmul units than on one with them, and far less on
a GPU.
Sarathi-Serve (Agrawal et al., OSDI 2024) picks the token budget from the time-between-tokens SLO
by offline profiling; this does it online.
"""

from __future__ import annotations

import numpy as np

__all__ = ["StepTimeModel"]

RIDGE = 1e-4  # of a coefficient's own sum of squares: pulls c and b towards 0 where the steps leave them free


class StepTimeModel:
    """Exponentially weighted least-squares fit of step seconds on (1, decode rows, prompt tokens).

    ``decay`` in (0, 1) weights the step ``k`` steps ago by ``decay**k`` (0.97: about the last 33
    steps). Until ``min_steps`` steps are seen (or while the fit is degenerate),
    :meth:`prompt_tokens_within` answers from a proportional model instead, seconds per computed
    row over the same steps. It charges the per-step cost to the rows, so where that cost dominates
    (small steps on a CPU) it errs small, and a cold worker does not take one huge first chunk.
    """

    def __init__(self, decay: float = 0.97, min_steps: int = 8) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._rows = 0.0  # weighted rows and seconds, for the proportional model
        self._seconds = 0.0

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Record one finished step: ``decode_rows`` sequences decoded one token each,
        ``prompt_tokens`` prompt positions computed, in ``seconds``."""
        x = np.array([1.0, decode_rows, prompt_tokens])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._rows = self.decay * self._rows + decode_rows + prompt_tokens
        self._seconds = self.decay * self._seconds + seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(a, c, b)``: seconds per step, per decode row, per prompt token; None before
        ``min_steps`` steps or while the steps seen do not determine a positive prompt-token cost.
        A small ridge term on ``c`` and ``b`` (relative to their own scale, none on ``a``) keeps the
        fit defined when the steps so far vary little: when they all decode about as many rows, the
        step's fixed cost stays in ``a`` (reading the weights, which a CPU step spends most of its
        time on) instead of being charged to the rows, whose cost a larger batch would then
        multiply."""
        if self.num_steps < self.min_steps:
            return None
        tiny = 1e-12 * max(np.trace(self._xtx), 1.0)  # keeps the system solvable when a column is all 0
        ridge = np.array([0.0, RIDGE, RIDGE]) * np.diag(self._xtx) + tiny
        a, c, b = np.linalg.solve(self._xtx + np.diag(ridge), self._xty)
        if not b > 0:
            return None
        return float(max(a, 0.0)), float(max(c, 0.0)), float(b)

    def prompt_tokens_within(self, seconds: float, decode_rows: int) -> int:
        """The most prompt tokens a step beside ``decode_rows`` decoding sequences can compute and
        still take at most ``seconds``: from the fit, else from the proportional model; 0 when the
        decode rows alone take longer, or before any step was seen."""
        fit = self.coefficients()
        if fit is not None:
            a, c, b = fit
            return max(0, int((seconds - a - c * decode_rows) / b))
        if self._rows <= 0 or self._seconds <= 0:
            return 0
        return max(0, int(seconds * self._rows / self._seconds) - decode_rows)
