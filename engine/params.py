"""Sampling parameters, their validation and per-step seeds. Torch-free (the router uses it)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Resolved sampling and stopping parameters of one request.

    ``temperature`` 0 means greedy. ``top_k`` 0 disables top-k; ``top_p`` 1 disables top-p.
    ``seed`` makes sampling reproducible: the draw for output token ``i`` depends only on
    (seed, i), never on the batch or the worker (see ``step_seed``). ``step_offset``: output tokens
    the request produced before it was migrated here (they are now part of its prompt); its ``i``
    counts on from there, so a migrated request draws exactly what it would have.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 16
    ignore_eos: bool = False
    step_offset: int = 0

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
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "step_offset": self.step_offset,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Inverse of ``to_dict``; ValueError for missing keys or bad values."""
        try:
            return cls(
                temperature=float(d["temperature"]),
                top_p=float(d["top_p"]),
                top_k=int(d["top_k"]),
                seed=int(d["seed"]),
                max_tokens=int(d["max_tokens"]),
                ignore_eos=bool(d["ignore_eos"]),
                step_offset=int(d.get("step_offset", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad sampling state: {exc!r}") from exc


def _shown(x: float) -> str:
    """``x`` as the client wrote it: the shortest decimal that reads back as ``x`` in float32, when
    ``x`` is a float32 (protobuf's float fields are, so a client's 0.7 arrives as 0.699999988...)."""
    try:
        as_f32 = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return repr(x)
    if as_f32 != x:
        return repr(x)
    for digits in range(1, 10):
        short = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == x:
            return repr(short)
    return repr(x)


def sampling_field_errors(temperature: float, top_p: float, top_k: int, max_tokens: int) -> list[tuple[str, str]]:
    """Problems with sampling values as ``(field, what is wrong)`` pairs, the field's name left out
    of the text ([] when valid), so a caller can name the field as its client does (the router)."""
    errors = []
    if not (temperature >= 0.0) or temperature == float("inf"):
        errors.append(("temperature", f"must be a finite number >= 0, got {_shown(temperature)}"))
    if not (0.0 < top_p <= 1.0):
        errors.append(("top_p", f"must be in (0, 1], got {_shown(top_p)}"))
    if top_k < 0:
        errors.append(("top_k", f"must be >= 0 (0 disables), got {top_k}"))
    if max_tokens < 1:
        errors.append(("max_tokens", f"must be >= 1, got {max_tokens}"))
    return errors


def sampling_errors(temperature: float, top_p: float, top_k: int, max_tokens: int) -> list[str]:
    """Human-readable problems with sampling values ([] when valid), each starting with its field."""
    return [f"{field} {what}" for field, what in sampling_field_errors(temperature, top_p, top_k, max_tokens)]


def step_seed(seed: int, step: int) -> int:
    """Seed for the draw of output token ``step`` (0-based): a SplitMix64 mix of (seed, step).

    Source: Steele, Lea, Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014).
    """
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
