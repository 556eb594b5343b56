"""Build, cache and load the C++ CPU kernels in ``csrc/`` (no torch headers, loaded with ctypes).

``csrc/paged_attention.cpp``: paged attention (decode and prefill). ``csrc/elementwise_bf16.cpp`` and
``csrc/elementwise_f32.cpp``: fused bfloat16 and float32 RMSNorm (+ residual add), SiLU-and-multiply and
RoPE. ``csrc/quant_linear.cpp``: int8 and
int4 weights times int8-quantized bfloat16 activations (AVX512-VNNI). ``csrc/dense_linear.cpp``:
bfloat16 (AVX512-BF16) and float32 (AVX-512F) weights times activations of their dtype.
``csrc/decoder_stack.cpp``: a Llama-style bfloat16 decoder stack through those kernels in one call.
``csrc/argmax_bf16.cpp``: greedy sampling's argmax over bfloat16 logits.

The library is compiled once per machine with the system C++ compiler (``$CXX``, else ``g++``)
and ``-march=native`` into ``$PDSERVE_CACHE_DIR/kernels`` (default ``~/.cache/pdserve/kernels``);
the file name hashes the source, the flags, the compiler and the CPU's feature flags, so an edit, a
new compiler or another CPU model builds afresh. A build takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.models.dtype import cpu_flags, has_amx
from pdserve.engine.models.embedded import default_cache_dir

CSRC = Path(__file__).with_name("csrc")
_SOURCE_NAMES = (
    "paged_attention.cpp",
    "elementwise_bf16.cpp",
    "elementwise_f32.cpp",
    "quant_linear.cpp",
    "dense_linear.cpp",
    "amx_linear.cpp",
    "amx_attention.cpp",
    "decoder_stack.cpp",
    "argmax_bf16.cpp",
)
SOURCES = tuple(CSRC / name for name in _SOURCE_NAMES)
HEADERS = (CSRC / "vec_math.h", CSRC / "amx_tiles.h", CSRC / "amx_attention_packed.h")
FLAGS = ("-O3", "-std=c++17", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_F, _N = ctypes.c_float, ctypes.c_int
_ATTENTION_ARGS = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I, _F, _N]
_ELEMENTWISE_ARGS = {
    "pdserve_add_rms_norm_bf16": [_P, _P, _P, _P, _I, _I, _F, _N],
    "pdserve_silu_mul_bf16": [_P, _P, _I, _I, _N],
    "pdserve_rope_bf16": [_P, _P, _P, _I, _I, _I, _I, _N],
    "pdserve_add_rms_norm_f32": [_P, _P, _P, _P, _I, _I, _F, _N],
    "pdserve_silu_mul_f32": [_P, _P, _I, _I, _N],
    "pdserve_rope_f32": [_P, _P, _P, _I, _I, _I, _I, _N],
    "pdserve_int8_linear_bf16": [_P, _P, _P, _P, _I, _I, _I, _N],
    "pdserve_int4_linear_bf16": [_P, _P, _P, _P, _I, _I, _I, _N],
    "pdserve_bf16_linear": [_P, _P, _P, _P, _I, _I, _I, _N],
    "pdserve_f32_linear": [_P, _P, _P, _P, _I, _I, _I, _N],
    "pdserve_bf16_amx_linear": [_P, _P, _P, _P, _I, _I, _I, _N],
    "pdserve_set_amx_attention": [_N],
    "pdserve_write_kv": [_P, _I, _P, _I, _P, _I, _P, _I, _I],
    "pdserve_gemma_rms_norm_bf16": [_P, _I, _P, _I, _P, _I, _I, _I, _F, _N],
    "pdserve_argmax_bf16": [_P, _I, _I, _I, _P, _N],
}
ATTENTION_SYMBOLS = {
    "float32": "pdserve_paged_attention_f32",
    "bfloat16": "pdserve_paged_attention_bf16",
    "float16": "pdserve_paged_attention_f16",
}


# csrc/dense_linear.cpp's function for each weight dtype, and the inputs each of its steps takes (E)
DENSE_KERNELS = {torch.bfloat16: ("pdserve_bf16_linear", 2), torch.float32: ("pdserve_f32_linear", 1)}


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here (no compiler, or the build failed)."""


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True)
        if proc.returncode != 0:
            reason = proc.stderr.strip()[-2000:] or f"exit status {proc.returncode}"
            raise KernelUnavailable(f"{cxx} failed to build the CPU kernels: {reason}")
        os.replace(tmp, out)  # atomic: a concurrent builder's file is equally good
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_cpu_kernels() -> ctypes.CDLL:
    """The loaded kernel library, built on first use. Raises KernelUnavailable."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found ($CXX or g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    cpu = " ".join(sorted(cpu_flags())) or os.uname().machine
    key = hashlib.sha256("\0".join([*texts, *FLAGS, version, cpu]).encode()).hexdigest()
    path = default_cache_dir() / "kernels" / f"pdserve-cpu-{key[:16]}.so"
    if not path.is_file():
        _build(cxx, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
    for symbol, args in [*((s, _ATTENTION_ARGS) for s in ATTENTION_SYMBOLS.values()), *_ELEMENTWISE_ARGS.items()]:
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = args, None
    supported = ("pdserve_quant_linear_supported", "pdserve_bf16_amx_linear_supported")
    for symbol in (*supported, *(f"{s}_supported" for s, _ in DENSE_KERNELS.values())):
        getattr(lib, symbol).argtypes, getattr(lib, symbol).restype = [], _N
    return lib


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as a contiguous [rows, K] (x itself when it already is one), as the kernels read it."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


class VnniLinear:
    """One quantized weight's calls into ``csrc/quant_linear.cpp``: ``symbol``
    (``pdserve_int8_linear_bf16`` or ``pdserve_int4_linear_bf16``) over ``packed`` and ``scales`` in
    that file's layout, on ``torch.get_num_threads()`` threads. Pointers are read once, at build:
    the per-call cost is one ctypes call and one output tensor (about 3 µs)."""

    def __init__(self, fn, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> None:
        self.fn, self.packed, self.scales, self.out_features = fn, packed, scales, out_features
        self._packed_ptr, self._scales_ptr = packed.data_ptr(), scales.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16, contiguous -> y [M, out_features] bfloat16."""
        m, k = x.shape
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        self.fn(x.data_ptr(), self._packed_ptr, self._scales_ptr, y.data_ptr(), m, self.out_features, k,
                torch.get_num_threads())  # fmt: skip
        return y


def vnni_linear(symbol: str, weight: torch.Tensor, pack: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
    """A ``VnniLinear`` for ``symbol`` over ``pack()``'s (packed, scales), or None where the kernel
    cannot take ``weight`` [out_features, in_features]: not a bfloat16 CPU tensor, out_features not a
    multiple of 16 or in_features of 32, no AVX512-VNNI, or no kernels here (``KernelUnavailable``).
    ``pack`` runs only where the kernel will."""
    n, k = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or n % 16 or k % 32:
        return None
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable:
        return None
    if not lib.pdserve_quant_linear_supported():
        return None
    return VnniLinear(getattr(lib, symbol), *pack(), n)


class DenseLinear:
    """y = x @ weight.T + bias through ``csrc/dense_linear.cpp`` on ``torch.get_num_threads()``
    threads, over the weight packed once into that file's layout ``[N / 16, K / E, 16, E]`` (E = 2
    for bfloat16, 1 for float32; the only copy kept). ``fn`` is that file's function for the dtype,
    or ``csrc/amx_linear.cpp``'s ``pdserve_bf16_amx_linear``, which reads the same packed bfloat16
    weight. x [..., in_features] in the weight's dtype -> [..., out_features]. Raises TypeError for
    activations of another dtype."""

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        e = DENSE_KERNELS[weight.dtype][1]
        self.fn, self.dtype, self.out_features, self.in_features = fn, weight.dtype, n, k
        self.packed = weight.reshape(n // 16, 16, k // e, e).permute(0, 2, 1, 3).contiguous()
        self.bias = bias.to(weight.dtype).contiguous() if bias is not None else None
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = self.bias.data_ptr() if self.bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_rows(x)
        if x2.dtype != self.dtype:
            raise TypeError(f"this linear takes {self.dtype} activations, not {x2.dtype}")
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=self.dtype)
        self.fn(x2.data_ptr(), self._packed_ptr, self._bias_ptr, y.data_ptr(), m, self.out_features,
                self.in_features, torch.get_num_threads())  # fmt: skip
        return y if x2 is x else y.view(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as loaded, [out_features, in_features] (unpacked for the call)."""
        return self.packed.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear | None:
    """A ``DenseLinear`` for ``weight`` [out_features, in_features], or None where its kernel does not
    take it: not a bfloat16 or float32 CPU tensor, out_features not a multiple of 16, in_features odd
    (bfloat16), no AVX512-BF16 (bfloat16) or AVX-512F (float32), or no kernels here
    (``KernelUnavailable``). On an AMX CPU only bfloat16 with in_features a multiple of 32 is taken,
    and every call runs on AMX tiles (``pdserve_bf16_amx_linear``): as fast as the AVX-512 kernel at
    one row in a decode step, faster from a few rows on, and a row's result then does not depend on
    how many rows the call has; the rest keeps oneDNN."""
    n, k = weight.shape
    symbol, e = DENSE_KERNELS.get(weight.dtype, (None, 1))
    amx = has_amx()
    if weight.device.type != "cpu" or symbol is None or n % 16 or k % e:
        return None
    if amx and (weight.dtype != torch.bfloat16 or k % 32):
        return None
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable:
        return None
    if not getattr(lib, f"{symbol}_supported")():
        return None
    if amx and not lib.pdserve_bf16_amx_linear_supported():
        return None
    return DenseLinear(lib.pdserve_bf16_amx_linear if amx else getattr(lib, symbol), weight, bias)


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """The first index of each row's maximum of bfloat16 CPU logits [rows, vocab] (rows contiguous
    along the vocabulary), as ``logits.max(dim=-1).indices`` gives it, through
    ``csrc/argmax_bf16.cpp`` on ``torch.get_num_threads()`` threads; None for other logits or where
    the kernels are unavailable (the caller keeps torch's)."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    try:
        lib = load_cpu_kernels()
    except KernelUnavailable:
        return None
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.pdserve_argmax_bf16(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out.tolist()
