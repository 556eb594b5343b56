"""Model identity a KV frame carries (:class:`ModelFingerprint`) and the codec's error type.

Both are re-exported by :mod:`pdserve.engine.kv.codec`, where callers import them from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class KvCodecError(ValueError):
    """Raised for any KV payload that cannot be packed or accepted; the message says exactly what
    is wrong, e.g. ``"model fingerprint mismatch: num_layers 4 != 5"`` or ``"checksum mismatch"``."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ModelFingerprint:
    """Identity of the model/KV layout; prefill and decode must agree exactly.

    ``dtype`` is the KV cache dtype name (``"float32"``, ``"float16"`` or
    ``"bfloat16"``); ``tokenizer_hash`` is the sha256 hex digest of tokenizer.json;
    ``weights_hash`` that of the weight files (``loader.weights_hash``), so that another model of
    the same shapes and tokenizer is told apart; ``config_hash`` that of config.json
    (``loader.config_hash``), so that the same weights under another RoPE base or scaling, norm
    epsilon or activation, which would compute other keys and values, are told apart too.
    ``architecture`` names the model family's architecture (config.json ``architectures[0]``), so
    KV from another family is refused by name, and ``layers`` each layer's KV layout
    (``layer_layout``: head_dim and sliding window). ``quantization`` is the weight-only
    quantization of the linears (``"none"``, ``"int8"`` or ``"int4"``, ``EngineConfig.quantization``):
    the same weights quantized otherwise compute other keys and values.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tokenizer_hash: str
    weights_hash: str = "-"
    config_hash: str = "-"
    layers: str = "-"
    quantization: str = "none"

    def to_dict(self) -> dict:
        """Plain dict of all fields, suitable for msgpack."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelFingerprint:
        """Build from a dict as produced by :meth:`to_dict`.

        Raises KvCodecError if ``d`` is not a dict, a key is missing or unknown,
        a value has the wrong type, or an integer field is not positive.
        """
        if not isinstance(d, dict):
            raise KvCodecError(f"fingerprint is not a map (got {type(d).__name__})")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                raise KvCodecError(f"fingerprint missing key {f.name!r}")
            v = d[f.name]
            if f.type == "int":
                if not _is_int(v) or v <= 0:
                    raise KvCodecError(f"fingerprint {f.name} must be a positive int, got {v!r}")
            elif not isinstance(v, str):
                raise KvCodecError(f"fingerprint {f.name} must be a str, got {type(v).__name__}")
            kwargs[f.name] = v
        if unknown := sorted(str(k) for k in d if k not in kwargs):
            raise KvCodecError(f"fingerprint has unknown keys: {', '.join(unknown)}")
        return cls(**kwargs)

    def digest(self) -> str:
        """sha256 hex of every field: what workers report, so a router can compare them at start."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def mismatches(self, other: ModelFingerprint) -> list[str]:
        """Differences as ``"<field> <self value> != <other value>"``; [] when equal."""
        pairs = [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)]
        return [f"{name} {a!r} != {b!r}" for name, a, b in pairs if a != b]


def layer_layout(head_dims: list[int], windows: list[int | None]) -> str:
    """Each layer's KV layout, runs of equal layers counted: ``"2x64/full,1x64/w4096"`` is two layers
    of head_dim 64 with full attention, then one that keeps a sliding window of 4096 positions."""
    runs: list[list] = []
    for item in (f"{d}/{'full' if w is None else f'w{w}'}" for d, w in zip(head_dims, windows, strict=True)):
        if runs and runs[-1][1] == item:
            runs[-1][0] += 1
        else:
            runs.append([1, item])
    return ",".join(f"{n}x{item}" for n, item in runs)


def layout_windows(layout: str) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from a ``layer_layout`` string; [] for
    ``"-"`` (a fingerprint without one). KvCodecError for a string ``layer_layout`` does not write."""
    if layout == "-":
        return []
    windows: list[int | None] = []
    try:
        for run in layout.split(","):
            count, item = run.split("x", 1)
            kind = item.split("/", 1)[1]
            window = None if kind == "full" else int(kind.removeprefix("w"))
            if not kind.startswith(("full", "w")) or int(count) < 1:
                raise ValueError(run)
            windows += [window] * int(count)
    except (ValueError, IndexError):
        raise KvCodecError(f"malformed layer layout {layout!r}") from None
    return windows
