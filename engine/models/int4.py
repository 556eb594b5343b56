"""Group-wise int4 weights (``--quantization int4``): quantizing, packing and the linear that runs them.

``w[n, k] ~= (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``q`` in [0, 15] and
``g = k // INT4_GROUP_SIZE``, the "tinygemm" convention of gpt-fast and torchao; the scale splits
the group's range in 15 steps, or is the step of a grid the group already lies on (``_grid_step``:
GGUF's Q4 blocks). Kernels, by where the linear runs:

* CPU with AVX512-VNNI, bfloat16 activations: ``csrc/quant_linear.cpp``, up to
  ``vnni_max_rows()`` rows (every call where the CPU has no AMX), over its own layout
  (``pack_for_vnni``); it quantizes the activations to int8 per group of 32 inputs (as llama.cpp's
  Q4_0 x Q8_0 dot does), whose error tests/engine/models/test_vnni_kernels.py bounds.
* Other CPUs: ``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``,
  up to ``TORCH_KERNEL_MAX_ROWS`` rows.
* CUDA: ``aten._convert_weight_to_int4pack`` + ``aten._weight_int4pack_mm`` (bfloat16 only), up to
  ``TORCH_KERNEL_MAX_ROWS`` rows.

More rows (a long prefill) dequantize the weight for the call and run the model dtype's GEMM.

``INT4_GROUP_SIZE`` is 32: SmolLM2's hidden size 576 is not a multiple of 128, 32 is the block of
GGUF's Q4_0 / Q4_1 / Q4_K formats (so their weights requantize without loss but for the rounding of
scale and zero), and group sizes 32 and 64 ran within 5 % of each other in torch's CPU kernel
(docs/measurements.md).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pdserve.engine.models.dtype import has_amx
from pdserve.engine.models.kernels import as_rows, vnni_linear

INT4_GROUP_SIZE = 32
INT4_INNER_K_TILES = 8  # CUDA tinygemm's tiling of K; needs in_features % (8 * 16) == 0
# Rows up to which torch's int4 kernels beat the dequantized GEMM: about 48 on SmolLM2's shapes, one
# and two threads (docs/measurements.md)
TORCH_KERNEL_MAX_ROWS = 48
# Rows up to which csrc/quant_linear.cpp runs (int8 and int4) on a CPU with AMX, where the weight
# dequantized for the call and AMX's bfloat16 GEMM win on larger calls. Measured on SmolLM2's shapes
# with the kernel's AMX-INT8 path (2-core Xeon with AMX, 2 threads, docs/measurements.md): the kernel
# took 0.5x the dequantized GEMM's time at 256 rows, 0.95-0.98x at 512 and 1.1-1.6x at 1,024. Without
# AMX the kernels take every call: on SmolLM2's shapes they beat even the plain bfloat16 GEMM at 2,048
# rows (AMD EPYC, AVX512-BF16).
AMX_VNNI_MAX_ROWS = 512


def vnni_max_rows() -> int:
    """Rows up to which the AVX512-VNNI kernels run a call: ``AMX_VNNI_MAX_ROWS`` on a CPU with AMX,
    else every call (``sys.maxsize``)."""
    return AMX_VNNI_MAX_ROWS if has_amx() else sys.maxsize


def _grid_step(w: torch.Tensor, lo: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """For groups w [N, G, g] whose values already lie on a grid of at most 16 levels (weights read
    from GGUF's Q4_0, Q4_1 or Q4_K blocks), that grid's step; elsewhere ``span / 15`` (min-max).

    The smallest gap between the group's distinct values (gaps under 1e-4 of the span are taken
    for float noise) gives the number of levels the span covers, and the span over that number the
    step. It is kept where the span covers at most 15 steps and every value lies on a level, within
    1e-3 steps plus what rounding the weights to bfloat16 moves it (up to 2**-7 of the group's
    largest magnitude, as the value, the minimum and the span each round; twice that is allowed)."""
    gaps = w.sort(dim=-1).values.diff(dim=-1)
    gaps = torch.where(gaps > span[..., None] * 1e-4, gaps, torch.inf)
    levels = (span / gaps.amin(dim=-1)).round().clamp(min=1)  # [N, G]; 1 for a constant group
    step = span / levels
    off = (w - lo[..., None]) / step[..., None]
    tolerance = 1e-3 + 2.0**-6 * w.abs().amax(dim=-1) / step
    on_grid = (levels <= 15) & ((off - off.round()).abs().amax(dim=-1) <= tolerance)
    return torch.where(on_grid & (span > 0), step, span / 15.0)


def quantize_int4(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4: weight [N, K] -> (q int32 in [0, 15] [N, K], scales_and_zeros
    ``dtype`` [K // group_size, N, 2]), with ``w ~= (q - 8) * scale + zero``.

    The scale is the group's range over 15 steps, or the step of the grid its values already lie
    on (``_grid_step``: a GGUF file's Q4 blocks then requantize without loss). Scale and zero are
    rounded to ``dtype`` (the kernel reads them in the activation dtype) before ``q`` is chosen
    against them. Raises ValueError when K is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scales = _grid_step(w, lo, hi - lo).clamp(min=1e-8).to(dtype)
    zeros = (lo + 8.0 * scales.float()).to(dtype)
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8.0).clamp(0, 15)
    sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return q.to(torch.int32).view(n, k), sz


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
    """Inverse of ``quantize_int4``: float32 [N, K]."""
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    w = (q.view(n, k // group_size, group_size).float() - 8.0) * sz[..., :1] + sz[..., 1:]
    return w.view(n, k)


class Int4Linear:
    """y = x @ dequantize(q).T + bias for x [T, in_features] -> [T, out_features]; groups of
    ``group_size`` inputs share a scale and a zero (``quantize_int4``).

    Calls of up to ``kernel_rows`` rows run the kernel of the module docstring over its packed
    layout: ``vnni_rows`` (``vnni_max_rows()``) where the VNNI kernel runs, else
    ``TORCH_KERNEL_MAX_ROWS`` (``vnni_rows`` is then 0). More rows
    dequantize the weight for the call and run the model dtype's GEMM. Where the VNNI kernel runs,
    that reads its packed copy: half a byte per weight in all. Elsewhere it reads ``nibbles``
    [N, G, group_size / 2], the same values two a byte, a group's first half in the high nibbles and
    its second half in the low ones, beside torch's packed copy: one byte per weight. Plus a scale
    and a zero per group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE) -> None:
        q, self.scales_and_zeros = quantize_int4(weight, group_size, weight.dtype)
        self.group_size, self.bias, self.out_features = group_size, bias, weight.shape[0]
        self.cuda = weight.device.type == "cuda"
        n, k = weight.shape
        self.in_features = k
        self._vnni = None
        if group_size == 32:  # the VNNI kernel's group
            self._vnni = vnni_linear(
                "pdserve_int4_linear_bf16", weight, lambda: pack_for_vnni(q, self.scales_and_zeros)
            )
        self.vnni_rows = vnni_max_rows() if self._vnni is not None else 0
        self.kernel_rows = self.vnni_rows or TORCH_KERNEL_MAX_ROWS
        self.nibbles = None
        if self._vnni is not None:
            self.packed = self._vnni.packed
        else:
            groups = q.view(n, k // group_size, group_size).to(torch.uint8)
            half = group_size // 2
            self.nibbles = (groups[..., :half] << 4 | groups[..., half:]).contiguous()
            if self.cuda:  # tinygemm's input: two a byte along K, the even column in the high nibble
                pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
        self._scale = sz[..., :1].contiguous()  # [N, G, 1] float32
        self._offset = (sz[..., 1:] - 8.0 * sz[..., :1]).contiguous()  # zero - 8 * scale

    def _halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q of each group's first and second half, uint8 [N, G, group_size / 2] each."""
        if self.nibbles is not None:
            return self.nibbles >> 4, self.nibbles & 15
        n, g = self.out_features, self.packed.shape[1]  # packed [N / 16, G, 4, 16, 4] (pack_for_vnni)
        first = (self.packed & 15).permute(0, 3, 1, 2, 4).reshape(n, g, 16)
        return first, (self.packed >> 4).permute(0, 3, 1, 2, 4).reshape(n, g, 16)

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [N, K] in ``dtype``: ``q * scale + (zero - 8 * scale)`` in float32,
        rounded once."""
        first, second = self._halves()
        n, g, half = first.shape
        w = torch.empty(n, g, 2 * half, dtype=torch.float32, device=first.device)
        w[..., :half], w[..., half:] = first, second
        return w.mul_(self._scale).add_(self._offset).view(n, -1).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_rows(x)
        m = x2.shape[0]
        if m > self.kernel_rows:
            y = F.linear(x2, self._weight(x2.dtype))
        elif self.vnni_rows and x2.dtype == torch.bfloat16:
            y = self._vnni(x2)
        elif self.vnni_rows:  # activations in another dtype than the weight's (not built by the engine)
            y = F.linear(x2, self._weight(x2.dtype))
        elif self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y += self.bias
        return y if x2 is x else y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this linear computes with, float32 [out_features, in_features]."""
        return self._weight(torch.float32)


def pack_for_vnni(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``csrc/quant_linear.cpp``'s layout of ``quantize_int4``'s output (q int32 [N, K] in [0, 15],
    scales_and_zeros bfloat16 [K / 32, N, 2], group size 32):

    - packed uint8 [N / 16, K / 32, 4, 16, 4]: byte [nb, g, p, l, b] holds q[16 nb + l, 32 g + 4 p + b]
      in its low nibble and q[16 nb + l, 32 g + 16 + 4 p + b] in its high nibble;
    - sz bfloat16 [N / 16, K / 32, 2, 16]: the 16 channels' scales, then their zeros.

    Raises ValueError unless N % 16 == 0 and K % 32 == 0."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"the int4 CPU kernel needs out_features % 16 == 0 and in_features % 32 == 0, got {n} x {k}")
    groups = k // 32
    q6 = q.to(torch.uint8).view(n // 16, 16, groups, 2, 4, 4)  # [nb, l, g, half, p, b]
    low, high = q6[:, :, :, 0].permute(0, 2, 3, 1, 4), q6[:, :, :, 1].permute(0, 2, 3, 1, 4)
    sz = scales_and_zeros.view(groups, n // 16, 16, 2).permute(1, 0, 3, 2).contiguous()
    return (low | high << 4).contiguous(), sz


def int4_unsupported(shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the int4 kernels cannot take a [out_features, in_features] weight, or None when they can:
    CPU needs out_features % 16 == 0 and in_features % ``INT4_GROUP_SIZE`` == 0; CUDA needs
    out_features % 8 == 0, in_features % 128 == 0 (``INT4_INNER_K_TILES`` x 16) and bfloat16."""
    n, k = shape
    cuda = device.type == "cuda"
    n_mult, k_mult = (8, INT4_INNER_K_TILES * 16) if cuda else (16, INT4_GROUP_SIZE)
    if n % n_mult or k % k_mult:
        return f"needs out_features % {n_mult} == 0 and in_features % {k_mult} == 0"
    if cuda and dtype != torch.bfloat16:
        return "CUDA's int4 kernel takes bfloat16 activations only"
    return None
