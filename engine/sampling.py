"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Resolved sampling and stopping parameters of one request.

    ``temperature`` 0 means greedy. ``top_k`` 0 disables top-k; ``top_p`` 1 disables top-p.
    ``seed`` makes sampling reproducible: the draw for output token ``i`` depends only on
    (seed, i), never on the batch or the worker (see ``step_seed``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        errors = sampling_errors(self.temperature, self.top_p, self.top_k, self.max_tokens)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        """Plain dict for the KV payload header."""
        return {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "max_tokens": self.max_tokens, "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Inverse of ``to_dict``; ValueError for missing keys or bad values."""
        try:
            return cls(
                temperature=float(d["temperature"]), top_p=float(d["top_p"]), top_k=int(d["top_k"]),
                seed=int(d["seed"]), max_tokens=int(d["max_tokens"]), ignore_eos=bool(d["ignore_eos"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad sampling state: {exc!r}") from exc


def sampling_errors(temperature: float, top_p: float, top_k: int, max_tokens: int) -> list[str]:
    """Human-readable problems with sampling values ([] when valid). Shared with the router."""
    errors = []
    if not (temperature >= 0.0) or temperature == float("inf"):
        errors.append(f"temperature must be a finite number >= 0, got {temperature}")
    if not (0.0 < top_p <= 1.0):
        errors.append(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        errors.append(f"top_k must be >= 0 (0 disables), got {top_k}")
    if max_tokens < 1:
        errors.append(f"max_tokens must be >= 1, got {max_tokens}")
    return errors


def step_seed(seed: int, step: int) -> int:
    """Seed for the draw of output token ``step`` (0-based): a SplitMix64 mix of (seed, step).

    Source: Steele, Lea, Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014).
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample(logits: torch.Tensor, params: Seq[SamplingParams], steps: Seq[int]) -> list[int]:
    """Sample one token per row.

    logits: [num_seqs, vocab_size] (any float dtype; computed in float32).
    params[i], steps[i]: the sampling parameters and output-token index of row i.
    Returns the token ids, one per row. Greedy rows take the argmax; the others draw from the
    temperature-scaled, top-k / top-p filtered distribution with a generator seeded by
    ``step_seed(seed, step)``, so a row's draw does not depend on the other rows.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = (cum - sorted_probs) > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(step_seed(p.seed, steps[i]))
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
