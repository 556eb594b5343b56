"""Linear layers whose weights are laid out once, at load time, for the device's fastest GEMM.

On an AVX-512 CPU without AMX, bfloat16 (with AVX512-BF16) and float32 weights run pdserve's own
kernel (``csrc/dense_linear.cpp``, ``kernels.DenseLinear``): a decode step's few rows stream the
weight near the memory's read bandwidth, where oneDNN's GEMM read it at about half, and larger calls
run at about oneDNN's rate. On an AMX CPU, bfloat16 weights run AMX tiles over the same packed weight
(``csrc/amx_linear.cpp``) (figures: docs/measurements.md). Elsewhere on CPU (float32 on AMX CPUs
among them), oneDNN's packed (blocked) weight format lets ``torch.ops.mkldnn._linear_pointwise``
skip the per-call reorder that ``F.linear`` pays, which matters most at decode's small row counts.
These are the ops Inductor's freezing pass emits (``torch/_inductor/fx_passes/mkldnn_fusion.py``).
Everywhere else, and for dtypes oneDNN cannot pack on this CPU (float16 without AVX512-FP16), the
weight stays a plain tensor for ``F.linear``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine.models.kernels import dense_linear
from pdserve.engine.models.quant import current_scheme, quantized_linear

# oneDNN picks its blocked layout for this many rows; 1-32 rows measured equal, 2048 slower at 32
PACK_ROWS_HINT = 32


class Linear(Protocol):
    """y = x @ weight.T + bias for x [num_tokens, in_features] -> [num_tokens, out_features]."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class PlainLinear:
    """``F.linear`` over the weight as loaded."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """oneDNN linear over a weight reordered once into its blocked layout (CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, quantizable: bool = False, lm_head: bool = False
) -> Linear:
    """The fastest linear for ``weight`` [out_features, in_features] on its device and dtype.

    ``quantizable`` (the decoder layers' projections and experts) or ``lm_head``: quantized when a
    ``quant.quantization`` scheme other than "none" is in force for it and the weight can take it
    (``quant.quantized_linear``). Else a bfloat16 or float32 weight takes ``kernels.dense_linear``
    where that kernel runs; else oneDNN packing is tried once, and a weight oneDNN refuses (wrong
    device, dtype or CPU) stays plain.
    """
    scheme = current_scheme(lm_head) if quantizable or lm_head else "none"
    if scheme != "none":
        quantized = quantized_linear(weight, bias, scheme)
        if quantized is not None:
            return quantized
    own = dense_linear(weight, bias)
    if own is not None:
        return own
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            return PackedLinear(weight.contiguous(), bias)
        except RuntimeError:
            pass
    return PlainLinear(weight, bias)


def fuse_rows(*tensors: torch.Tensor | None, sizes: tuple[int, ...]) -> torch.Tensor | None:
    """Concatenate weights (or biases) of ``sizes[i]`` output rows along dim 0: [sum(sizes), ...].

    None when every tensor is None; a missing bias beside present ones is zeros.
    """
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    ref = present[0]
    parts = [t if t is not None else ref.new_zeros((n, *ref.shape[1:])) for t, n in zip(tensors, sizes)]
    return torch.cat(parts, dim=0)
