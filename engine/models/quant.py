"""Weight quantization of the decoder's linears (``--quantization int8|int4``) and of lm_head
(``--lm-head-quantization``).

Weights are quantized once, at load time, from the model-dtype weight; the KV cache, embeddings,
norms and the MoE router stay in the model dtype, and so do activations, but inside the AVX512-VNNI
CPU kernels, which quantize them to int8 per block:

* ``int8`` (``Int8Linear``, here): symmetric, one scale per output channel: ``w[n, k] ~= q[n, k] *
  scale[n]`` with ``q`` in [-127, 127], ``scale[n] = max_k |w[n, k]| / 127``. Kernels:
  ``csrc/quant_linear.cpp`` on AVX512-VNNI CPUs (bfloat16 calls of up to ``vnni_max_rows()`` rows:
  all where the CPU has no AMX), else ``aten._weight_int8pack_mm`` (CPU and CUDA), which takes the
  int8 weight [N, K] and the scales [N] as they are, up to ``KERNEL_MAX_ROWS["int8"]`` rows.
* ``int4`` (``Int4Linear``, engine/models/int4.py): asymmetric, group-wise over 32 inputs, the
  "tinygemm" convention; its kernels and their row limits are described there.

Larger calls dequantize the weight for the call and run the dense GEMM. Scales and zeros are stored in
the activation dtype, as the kernels read them. A linear the int4 kernel cannot take
(``int4_unsupported``) stays in the model dtype, with a log line.

Which scheme ``make_linear`` applies is set for the duration of a model's build by
``quantization(scheme)`` (the model runner wraps the family's ``build`` in it).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.models.int4 import (  # noqa: F401 (the int4 scheme's names, re-exported)
    INT4_GROUP_SIZE,
    TORCH_KERNEL_MAX_ROWS,
    Int4Linear,
    dequantize_int4,
    int4_unsupported,
    quantize_int4,
    vnni_max_rows,
)
from pdserve.engine.models.kernels import as_rows, vnni_linear

log = logging.getLogger(__name__)
# Calls of at most this many rows (decode steps) run torch's weight-only kernels, whose cost grows by
# about one weight pass per row; more rows dequantize the weight for the call and run the dense
# GEMM, whose cost per row is far lower. The kernels and the dequantized GEMM cost the same at about
# 24 rows (int8) and 48 rows (int4) on SmolLM2's shapes, one and two threads (docs/measurements.md).
# The AVX512-VNNI kernels run far more rows (vnni_max_rows).
KERNEL_MAX_ROWS = {"int8": 24, "int4": TORCH_KERNEL_MAX_ROWS}

_warned: list[bool] = []  # the float32 warning is logged once a process
_scheme: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar(  # (decoder layers', lm_head's)
    "pdserve_quantization", default=("none", "none")
)


@contextlib.contextmanager
def quantization(scheme: str, lm_head: str = "none") -> Iterator[None]:
    """Within the block, ``make_linear(..., quantizable=True)`` quantizes with ``scheme`` and
    ``make_linear(..., lm_head=True)`` with ``lm_head``.

    Raises ValueError for a scheme not in ``QUANTIZATIONS``.
    """
    for name, value in (("quantization", scheme), ("lm_head_quantization", lm_head)):
        if value not in QUANTIZATIONS:
            raise ValueError(f"{name} must be one of {', '.join(QUANTIZATIONS)}, got {value!r}")
    token = _scheme.set((scheme, lm_head))
    try:
        yield
    finally:
        _scheme.reset(token)


def current_scheme(lm_head: bool = False) -> str:
    """The scheme ``quantization`` set for the decoder layers' linears (for lm_head with
    ``lm_head``), "none" outside it."""
    return _scheme.get()[1 if lm_head else 0]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [N, K] -> (q int8 [N, K], scales float32 [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack_int8_for_vnni(q: torch.Tensor) -> torch.Tensor:
    """``csrc/quant_linear.cpp``'s layout of an int8 weight q [N, K]: uint8 [N / 16, K / 32, 8, 16, 4],
    byte [nb, g, p, l, b] = q[16 nb + l, 32 g + 4 p + b] + 128. Raises ValueError unless N % 16 == 0
    and K % 32 == 0."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"the int8 CPU kernel needs out_features % 16 == 0 and in_features % 32 == 0, got {n} x {k}")
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8)
    return unsigned.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


class Int8Linear:
    """y = x @ (q * scale).T + bias for x [T, in_features] in the model dtype -> [T, out_features].

    On a CPU with AVX512-VNNI and bfloat16 activations (and out_features % 16 == 0, in_features % 32
    == 0), calls of up to ``vnni_rows`` rows (``vnni_max_rows()``) run ``csrc/quant_linear.cpp`` over
    ``packed`` (``pack_int8_for_vnni``), which also quantizes x to int8 per group of 32 inputs (its
    error is stated in docs/models.md); elsewhere calls of up to ``KERNEL_MAX_ROWS["int8"]`` rows run
    ``_weight_int8pack_mm`` (weight-only) over ``qweight``. More rows (a prefill, a large decode batch)
    run the model dtype's GEMM over the weight dequantized for the call. Memory: one byte per weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scales = quantize_int8(weight)
        self.scales, self.bias = scales.to(weight.dtype), bias
        self.out_features, self.in_features = weight.shape
        self._vnni = vnni_linear(
            "pdserve_int8_linear_bf16", weight, lambda: (pack_int8_for_vnni(q), scales.float().contiguous())
        )
        self.vnni_rows = vnni_max_rows() if self._vnni is not None else 0
        self.packed, self.qweight = (self._vnni.packed, None) if self._vnni is not None else (None, q)

    def _int8_weight(self) -> torch.Tensor:
        """q [N, K] int8, unpacked from ``packed`` where the VNNI kernel runs."""
        if self.qweight is not None:
            return self.qweight
        unsigned = self.packed.permute(0, 3, 1, 2, 4).reshape(self.out_features, self.in_features)
        return (unsigned.to(torch.int16) - 128).to(torch.int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_rows(x)
        m = x2.shape[0]
        if m <= self.vnni_rows and x2.dtype == torch.bfloat16:
            y = self._vnni(x2)
        elif m <= KERNEL_MAX_ROWS["int8"] and self.qweight is not None:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:  # the weight dequantized for the call: N * K products, where scaling y would cost M * N
            y = F.linear(x2, self._int8_weight().to(x2.dtype).mul_(self.scales[:, None]))
        if self.bias is not None:
            y += self.bias
        return y if x2 is x else y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this linear computes with, float32 [out_features, in_features]."""
        return self._int8_weight().float() * self.scales.float()[:, None]


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> Int8Linear | Int4Linear | None:
    """``scheme``'s linear for ``weight`` [out_features, in_features], or None when this weight
    cannot take it (``int4_unsupported``; the caller keeps it in the model dtype)."""
    if weight.device.type == "cpu" and weight.dtype != torch.bfloat16 and not _warned:
        _warned.append(True)
        log.warning(
            "%s weights with %s activations: the CPU kernels are fast with bfloat16 activations only (float32 and "
            "float16 measured slower than without quantization, docs/models.md#quantization); pass --dtype bfloat16",
            scheme,
            weight.dtype,
        )
    if scheme == "int8":
        return Int8Linear(weight, bias)
    why = int4_unsupported(tuple(weight.shape), weight.device, weight.dtype)
    if why is not None:
        log.info("int4: a %s %s linear stays %s: %s", tuple(weight.shape), weight.device.type, weight.dtype, why)
        return None
    return Int4Linear(weight, bias)
