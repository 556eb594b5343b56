"""The decoder's elementwise ops (RMSNorm with residual add, SiLU-and-multiply, RoPE, the KV cache
write), chosen once.

``TorchOps`` is transformers' eager arithmetic op for op. ``CpuBf16Ops`` and ``CpuF32Ops`` run each
op as one fused C++ pass (``csrc/elementwise_bf16.cpp``, ``csrc/elementwise_f32.cpp``; the KV write:
``csrc/paged_attention.cpp``, one call a layer) on CPU tensors of their dtype, where eager torch makes
3-8 passes (and, in bfloat16, float32 round trips). They round where eager torch rounds, so they
differ from it only by an ulp where exp() or the order of a sum does (RMSNorm's sum of squares,
SiLU's exp); the residual add and RoPE give the same bits.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels

log = logging.getLogger(__name__)


class ElementwiseOps(Protocol):
    name: str

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` in place (skipped when None), then RMSNorm (Zhang & Sennrich 2019)
        of it: [num_tokens, hidden] -> [num_tokens, hidden]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] (gate | up) -> silu(gate) * up, [num_tokens, inter]."""
        ...

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [num_tokens, heads, head_dim] in place (last dim contiguous) by cos/sin
        [num_tokens, head_dim] (RoFormer, Su et al. 2021; rotate-half layout)."""
        ...

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k and v [num_tokens, num_kv_heads, head_dim] (each row contiguous) into one layer's
        contiguous cache [2, num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping
        [num_tokens] int64 (slot = block * block_size + offset)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, cast back, then scaled (transformers' LlamaRMSNorm)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    name = "torch"

    def add_rms_norm(self, residual, delta, weight, eps):
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up):
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rope_(self, x, cos, sin):
        x.copy_(x * cos[:, None, :] + rotate_half(x) * sin[:, None, :])

    def write_kv(self, cache, k, v, slot_mapping):
        flat = cache.view(2, -1, *k.shape[1:])  # [2, num_slots, num_kv_heads, head_dim]
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)


class CpuFusedOps:
    """The fused C++ ops for CPU tensors of one dtype (``SUFFIX`` names their symbols)."""

    SUFFIX = ""

    def __init__(self) -> None:
        lib = load_cpu_kernels()
        self.name = f"cpu-{self.SUFFIX}"
        self._norm, self._silu, self._rope, self._write_kv = (
            getattr(lib, f"pdserve_add_rms_norm_{self.SUFFIX}"),
            getattr(lib, f"pdserve_silu_mul_{self.SUFFIX}"),
            getattr(lib, f"pdserve_rope_{self.SUFFIX}"),
            lib.pdserve_write_kv,
        )

    def add_rms_norm(self, residual, delta, weight, eps):
        out = torch.empty_like(residual)
        self._norm(
            out.data_ptr(),
            residual.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            residual.shape[0],
            residual.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def silu_mul(self, gate_up):
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._silu(out.data_ptr(), gate_up.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rope_(self, x, cos, sin):
        rows, heads, head_dim = x.shape
        self._rope(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim, x.stride(0), torch.get_num_threads()
        )

    def write_kv(self, cache, k, v, slot_mapping):
        size = k.element_size()
        self._write_kv(
            cache.data_ptr(), cache.stride(0) * size, k.data_ptr(), k.stride(0) * size, v.data_ptr(),
            v.stride(0) * size, slot_mapping.data_ptr(), k.shape[0], k.shape[1] * k.shape[2] * size,
        )  # fmt: skip


class CpuBf16Ops(CpuFusedOps):
    SUFFIX = "bf16"


class CpuF32Ops(CpuFusedOps):
    SUFFIX = "f32"


def select_ops(device: torch.device, dtype: torch.dtype) -> ElementwiseOps:
    """``CpuBf16Ops`` / ``CpuF32Ops`` for bfloat16 / float32 on a CPU where the kernels build, else
    ``TorchOps``."""
    fused = {torch.bfloat16: CpuBf16Ops, torch.float32: CpuF32Ops}.get(dtype)
    if device.type == "cpu" and fused is not None:
        try:
            return fused()
        except KernelUnavailable as exc:
            log.warning("elementwise ops: torch (%s)", exc)
    return TorchOps()
