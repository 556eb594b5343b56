"""RoPE frequencies (RoFormer, Su et al. 2021) with the scalings ``ModelConfig`` accepts.

Each follows transformers' ``modeling_rope_utils`` so that float32 output stays token-identical:
``linear`` (position interpolation), ``llama3`` (``_compute_llama3_parameters``), ``yarn``
(``_compute_yarn_parameters``, Peng et al. 2023) and ``longrope`` (``_compute_longrope_parameters``,
Ding et al. 2024; Phi-3's "su"), the last two with an attention factor that scales cos and sin.
With ``partial_rotary_factor`` below 1 the frequencies cover the first ``rotary_dim`` dims of a head.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] after the checkpoint's scaling."""
    return rope_parameters(cfg)[0]


def rotary_dim(cfg: ModelConfig) -> int:
    """The dims of each head RoPE turns: head_dim, or its first ``partial_rotary_factor`` part."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def rope_parameters(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2], the factor cos and sin are multiplied by)."""
    dim, base = rotary_dim(cfg), cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn(scaling, dim, base, cfg.max_position_embeddings)
    if kind == "longrope":
        return _longrope(scaling, dim, base, cfg.max_position_embeddings)
    return _llama3(scaling, inv_freq), 1.0


def _llama3(scaling: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1 report (Meta 2024): long wavelengths divided by ``factor``, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(scaling: dict, dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, a linear ramp between; the
    attention factor (``attention_factor``, else from ``factor`` and ``mscale``/``mscale_all_dim``)."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_positions / old_len
    factor = float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(scaling: dict, dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE: each frequency divided by its own factor, ``long_factor`` for a model that serves
    more than ``original_max_position_embeddings`` positions (config.json's
    ``max_position_embeddings`` is larger), else ``short_factor``; the attention factor
    (``attention_factor``, else sqrt(1 + ln(factor) / ln(original)) with ``factor`` defaulting to
    max_position_embeddings / original).

    transformers picks the factors by each forward's length and, in Phi-3's ``generate()``,
    recomputes the whole cache with the long ones once a sequence outgrows the original context.
    A paged server cannot follow that switch: keys cached (and shared through the prefix cache, or
    sent from prefill to decode) under one set would not match queries under the other. So the set
    is fixed per model, and equals transformers' at every length that model uses it for: sequences
    longer than the original context on a long-context checkpoint, any length on the others.
    """
    old_len = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = max_positions / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = scaling["long_factor"] if max_positions > old_len else scaling["short_factor"]
    ext_factors = torch.tensor(ext, dtype=torch.float32)
    if ext_factors.shape != (dim // 2,):
        raise ValueError(f"longrope factors have {len(ext)} entries; the rotary dims need {dim // 2}")
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**inv_freq_shape), float(attention_factor)
