"""The bfloat16 CPU decoder stack in one C++ call (``csrc/decoder_stack.cpp``): every layer's
kernels, in the order and with the arguments the Python layer loop gives them, without a Python
round trip per kernel (about 10 calls a layer; at batch 16 on the embedded 80M shape the loop's own
Python and ctypes time was ~15 % of a decode step, docs/measurements.md). Same bits as the loop.

Taken by ``CausalLM.forward`` when ``DecoderStack.build`` accepts the model: Llama-style layers
(``PreNormLayer`` of an ``Attention`` without q/k norms and a ``GatedMLP``), every linear a
``DenseLinear`` (pdserve's AMX or AVX-512 bf16 kernel) or an int8 / int4 linear on the VNNI kernel
(``--quantization``, no bias), the C++ elementwise ops and paged attention,
one cache per layer; and per step, full-width RoPE and one metadata for all layers. With a layer
hook (a prefill worker streams each layer's KV from it) the layers run one C++ call each, the hook
between them. ``PDSERVE_DECODER_STACK=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from pdserve.engine.models.attention import AttentionMetadata, CpuPagedAttention
from pdserve.engine.models.blocks import Attention, GatedMLP
from pdserve.engine.models.kernels import DenseLinear, KernelUnavailable, load_cpu_kernels
from pdserve.engine.models.ops import CpuBf16Ops
from pdserve.engine.models.quant import Int4Linear, Int8Linear

ENV = "PDSERVE_DECODER_STACK"
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [("fn", _P), ("packed", _P), ("aux", _P), ("n", _I), ("k", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Linear) for name in ("qkv", "o", "gate_up", "down")),
        ("post_norm", _P),
        ("next_norm", _P),
        ("attention", _P),
        ("scale", _F),
        ("softcap", _F),
        ("window", _I),
    ]


_STEP_INTS = ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "num_seqs", "block_size", "max_blocks")
_STEP_PTRS = ("caches", "h", "x", "cos", "sin", "slots", "block_tables", "context_lens", "query_start")
_SCRATCH = ("qkv", "attn", "proj", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in _STEP_INTS),
        ("plane_bytes", _I),
        ("eps", _F),
        ("threads", _N),
        *((name, _P) for name in (*_STEP_PTRS, *_SCRATCH)),
    ]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _stackable(lin) -> bool:
    """Whether the stack can call ``lin``'s kernel: a bfloat16 ``DenseLinear``, or an int8 / int4
    linear without bias whose weight the VNNI kernel holds (``csrc/quant_linear.cpp``)."""
    if type(lin) is DenseLinear:
        return lin.dtype == torch.bfloat16
    return type(lin) in (Int8Linear, Int4Linear) and lin._vnni is not None and lin.bias is None


def _linear(lin) -> _Linear:
    if type(lin) is DenseLinear:
        return _Linear(_address(lin.fn), lin._packed_ptr, lin._bias_ptr or 0, lin.out_features, lin.in_features)
    v = lin._vnni
    return _Linear(_address(v.fn), v._packed_ptr, v._scales_ptr, lin.out_features, lin.in_features)


def _linears(layer) -> tuple:
    return layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down


class DecoderStack:
    """The stack of one ``CausalLM`` (see the module docstring); ``__call__`` runs a step."""

    def __init__(self, lib, layers: list, shape: tuple[int, int, int, int, int], eps: float) -> None:
        self._fn = lib.pdserve_decoder_stack_bf16
        self._fn.argtypes, self._fn.restype = [_P, _I, _P], None
        self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter = shape
        self.eps = eps
        self._layers = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            attn, mlp, backend = layer.attn, layer.mlp, layer.attn.backend
            self._layers[i] = _Layer(
                _linear(attn.qkv), _linear(attn.o), _linear(mlp.gate_up), _linear(mlp.down),
                layer.post_norm.data_ptr(), layer.next_norm.data_ptr(), _address(backend._fn),
                backend.scale, backend.softcap or 0.0, backend.window or 0,
            )  # fmt: skip
        self._keep = layers  # the weights the pointers above point into
        # rows up to which every quantized linear's VNNI kernel runs a call (Int8Linear, Int4Linear)
        quantized = [lin.vnni_rows for layer in layers for lin in _linears(layer) if type(lin) is not DenseLinear]
        self.max_rows = min(quantized, default=sys.maxsize)
        self.calls = 0  # steps run through the stack

    @classmethod
    def build(cls, model) -> DecoderStack | None:
        """The stack for ``model`` (a ``CausalLM``), or None where it does not apply (module docstring)."""
        if os.environ.get(ENV, "1") == "0" or not isinstance(model.ops, CpuBf16Ops):
            return None
        for layer in model.layers:
            attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
            if type(attn) is not Attention or type(mlp) is not GatedMLP or attn.qk_norm is not None:
                return None
            if type(attn.backend) is not CpuPagedAttention or attn.ops is not model.ops or mlp.ops is not model.ops:
                return None
            if not all(_stackable(lin) for lin in _linears(layer)):
                return None
        try:
            lib = load_cpu_kernels()
        except KernelUnavailable:
            return None
        cfg, mlp = model.cfg, model.layers[0].mlp
        shape = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, mlp.down.in_features)
        return cls(lib, model.layers, shape, model.layers[0].eps)

    def takes(self, cos: torch.Tensor, meta, kv_cache) -> bool:
        """Whether this step can run here: full-width RoPE, no more rows than the quantized linears'
        kernels take (``max_rows``), one metadata for every layer and one contiguous cache per layer
        ([2, blocks, block_size, kv_heads, head_dim], all alike)."""
        return (
            cos.shape[-1] == self.head_dim
            and cos.shape[0] <= self.max_rows
            and isinstance(meta, AttentionMetadata)
            and len(kv_cache) == len(self._layers)
            and all(c.is_contiguous() and c.shape == kv_cache[0].shape for c in kv_cache)
        )

    def __call__(
        self, h: torch.Tensor, x: torch.Tensor, cos, sin, meta: AttentionMetadata, kv_cache, hook=None
    ) -> None:
        """Run every layer on h and x ([rows, hidden], updated in place: x ends as the stack's output);
        ``kv_cache``: each layer's cache, in layer order. ``hook``: None, or called as ``hook(i,
        kv_cache[i])`` right after layer i (``CausalLM.layer_hook``): the layers then run one call each."""
        rows = h.shape[0]
        scratch = {
            "qkv": torch.empty(rows, (self.heads + 2 * self.kv_heads) * self.head_dim, dtype=h.dtype),
            "attn": torch.empty(rows, self.heads * self.head_dim, dtype=h.dtype),
            "proj": torch.empty(rows, self.hidden, dtype=h.dtype),
            "gate_up": torch.empty(rows, 2 * self.inter, dtype=h.dtype),
            "act": torch.empty(rows, self.inter, dtype=h.dtype),
        }
        tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
        if {tables.dtype, lens.dtype, starts.dtype} != {torch.int32}:
            raise TypeError("the decoder stack needs int32 block_tables/context_lens/query_start_loc")
        caches = (_P * len(kv_cache))(*(c.data_ptr() for c in kv_cache))
        first = kv_cache[0]
        step = _Step(
            rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
            lens.shape[0], first.shape[2], tables.shape[1], first.stride(0) * first.element_size(),
            self.eps, torch.get_num_threads(),
            ctypes.addressof(caches), h.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            *(scratch[name].data_ptr() for name in _SCRATCH),
        )  # fmt: skip
        layers = ctypes.addressof(self._layers)
        if hook is None:
            self._fn(layers, len(self._layers), ctypes.addressof(step))
        else:
            for i in range(len(self._layers)):
                step.caches = ctypes.addressof(caches) + i * ctypes.sizeof(_P)
                self._fn(layers + i * ctypes.sizeof(_Layer), 1, ctypes.addressof(step))
                hook(i, kv_cache[i])
        self.calls += 1
