"""Weight quantization of the decoder's linears (``--quantization int8|int4``) and of lm_head
(``--lm-head-quantization``).

Weights are quantized once, at load time, from the model-dtype weight; the KV cache, embeddings,
norms and the MoE router stay in the model dtype, and so do activations, but for int8's CPU kernel
(``Int8Linear``). Each linear runs torch's own weight-only kernels, which dequantize a tile of the
weight inside the GEMM, or on AVX512-VNNI CPUs int8's ``csrc/int8_linear.cpp``:

* ``int8``: symmetric, one scale per output channel: ``w[n, k] ~= q[n, k] * scale[n]`` with
  ``q`` in [-127, 127], ``scale[n] = max_k |w[n, k]| / 127``. Kernel ``aten._weight_int8pack_mm``
  (CPU and CUDA), which takes the int8 weight [N, K] and the scales [N] as they are.
* ``int4``: asymmetric, group-wise over ``INT4_GROUP_SIZE`` consecutive inputs, the "tinygemm"
  convention of gpt-fast and torchao: ``w[n, k] ~= (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with
  ``q`` in [0, 15] and ``g = k // INT4_GROUP_SIZE``; the scale splits the group's range in 15
  steps, or is the step of a grid the group already lies on (``_grid_step``: GGUF's Q4 blocks).
  CPU: ``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``; CUDA:
  ``aten._convert_weight_to_int4pack`` + ``aten._weight_int4pack_mm`` (bfloat16 activations only).

The kernels take calls of up to ``KERNEL_MAX_ROWS`` rows (decode steps); larger calls (prefill)
dequantize the weight and run the dense GEMM. Scales and zeros are stored in the activation dtype,
as the kernels read them.

``INT4_GROUP_SIZE`` is 32: SmolLM2's hidden size 576 is not a multiple of 128, 32 is the block of
GGUF's Q4_0 / Q4_1 / Q4_K formats (so their weights requantize without loss but for the rounding of
scale and zero), and group sizes 32 and 64 ran within 5 % of each other in the CPU kernel
(docs/measurements.md). A linear the int4 kernel cannot take (``int4_unsupported``) stays in the
model dtype, with a log line.

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

log = logging.getLogger(__name__)
INT4_GROUP_SIZE = 32
# Calls of at most this many rows (decode steps) run the weight-only kernels, whose cost grows by
# about one weight pass per row; more rows dequantize the weight for the call and run the dense
# GEMM, whose cost per row is far lower. The kernels and the dequantized GEMM cost the same at about
# 24 rows (int8) and 48 rows (int4) on SmolLM2's shapes, one and two threads (docs/measurements.md)
KERNEL_MAX_ROWS = {"int8": 24, "int4": 48}
INT4_INNER_K_TILES = 8  # CUDA tinygemm's tiling of K; needs in_features % (8 * 16) == 0

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


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _int8_cpu_kernel(weight: torch.Tensor):
    """The C++ int8 x int8 kernel (``csrc/int8_linear.cpp``) and its most rows for this bfloat16 CPU
    weight, or (None, 0) where it cannot run (no AVX512-VNNI, no compiler, in_features % 64)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 64:
        return None, 0
    from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels

    try:
        lib = load_cpu_kernels()
    except KernelUnavailable:
        return None, 0
    rows = lib.pdserve_int8_linear_max_rows()
    return (lib.pdserve_int8_linear_bf16, rows) if rows else (None, 0)


class Int8Linear:
    """y = x @ (q * scale).T + bias for x [T, in_features] in the model dtype -> [T, out_features].

    On a CPU with AVX512-VNNI and bfloat16 activations, calls of up to ``vnni_rows`` rows (8) run
    ``csrc/int8_linear.cpp``, which also quantizes x to int8 per block of 16 inputs (its error is
    stated in docs/models.md); other calls of up to ``KERNEL_MAX_ROWS["int8"]`` rows run
    ``_weight_int8pack_mm`` (weight-only); more rows (a prefill, a large decode batch) run the model
    dtype's GEMM over the weight dequantized for the call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scales = quantize_int8(weight)
        self.qweight, self.scales, self.bias = q, scales.to(weight.dtype), bias
        self.out_features = weight.shape[0]
        self._vnni, self.vnni_rows = _int8_cpu_kernel(weight)
        self._scales_f32 = scales.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x)
        if x2.shape[0] <= self.vnni_rows and x2.dtype == torch.bfloat16:
            m, (n, k) = x2.shape[0], self.qweight.shape
            y = torch.empty(m, n, dtype=x2.dtype)
            self._vnni(
                x2.data_ptr(), self.qweight.data_ptr(), self._scales_f32.data_ptr(), y.data_ptr(), m, n, k,
                torch.get_num_threads(),
            )  # fmt: skip
        elif x2.shape[0] <= KERNEL_MAX_ROWS["int8"]:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:  # the weight dequantized for the call: N * K products, where scaling y would cost M * N
            y = F.linear(x2, self.qweight.to(x2.dtype).mul_(self.scales[:, None]))
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this linear computes with, float32 [out_features, in_features]."""
        return self.qweight.float() * self.scales.float()[:, None]


class Int4Linear:
    """y = x @ dequantize(q).T + bias for x [T, in_features] -> [T, out_features]; groups of
    ``group_size`` inputs share a scale and a zero (``quantize_int4``).

    Up to ``KERNEL_MAX_ROWS["int4"]`` rows run the int4 kernel over its packed layout; more rows (a
    prefill) dequantize the weight for the call from ``nibbles`` and run the model dtype's GEMM.
    ``nibbles`` [N, G, group_size / 2] holds the same values two a byte, a group's first half in
    the high nibbles and its second half in the low ones, so that each half dequantizes in one
    strided pass (the kernel's own layout depends on the shape and is not read here). Memory: one
    byte per weight (the two copies) plus a scale and a zero per group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE) -> None:
        q, self.scales_and_zeros = quantize_int4(weight, group_size, weight.dtype)
        self.group_size, self.bias, self.out_features = group_size, bias, weight.shape[0]
        self.cuda = weight.device.type == "cuda"
        n, k = weight.shape
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

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [N, K] in ``dtype``: ``q * scale + (zero - 8 * scale)`` in float32,
        rounded once."""
        n, g, half = self.nibbles.shape
        w = torch.empty(n, g, 2 * half, dtype=torch.float32, device=self.nibbles.device)
        w[..., :half] = self.nibbles >> 4
        w[..., half:] = self.nibbles & 15
        return w.mul_(self._scale).add_(self._offset).view(n, -1).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x)
        if x2.shape[0] > KERNEL_MAX_ROWS["int4"]:
            y = F.linear(x2, self._weight(x2.dtype))
        elif self.cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight this linear computes with, float32 [out_features, in_features]."""
        return self._weight(torch.float32)


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


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> Int8Linear | Int4Linear | None:
    """``scheme``'s linear for ``weight`` [out_features, in_features], or None when this weight
    cannot take it (``int4_unsupported``; the caller keeps it in the model dtype)."""
    if weight.device.type == "cpu" and weight.dtype != torch.bfloat16 and not _warned:
        _warned.append(True)
        log.warning(
            "--quantization %s with %s activations: torch's CPU weight-only kernels are fast with bfloat16 "
            "only (float32 measured slower than the unquantized float32 GEMM, docs/models.md#quantization)",
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
