#!/usr/bin/env python3
"""Where a decode step's time goes, beside the bound this machine allows, at several batch sizes.

    python benchmarks/decode_profile.py [--model embedded:llama-80m] [--dtype bfloat16] [--batch 1 8 32]
        [--context 256] [--steps 30] [--threads N] [--linear-kernel auto|onednn|dense] [--amx-attention on|off]
        [--torch-profile]

For each batch size, ``batch`` prompts of ``--context`` random tokens are prefilled, then
``--steps`` decode steps of the whole batch are timed (after 3 warm-up steps). Every part of the
step is timed by wrapping it (CPU work is synchronous, so wall time is exact; each wrapper costs
well under a microsecond). Where the decoder stack runs (bfloat16 on CPU, the default), every layer
is one C++ call and its parts share one row, ``layers (stack)``; ``PDSERVE_DECODER_STACK=0`` runs
the layer loop instead, each part below timed:

- ``linear``: the decoder's GEMMs (q|k|v, o, gate|up, down) through the engine's linear classes;
  their bound is reading every weight once at the bandwidth the read probe measures, or their
  FLOPs at the engine's own GEMM rate at this row count (``pdserve throughput``'s probes);
- ``lm_head``: the logits GEMM, bound as above;
- ``attention``: the backend's decode kernel; bound: reading the batch's KV cache once;
- ``elementwise``: RMSNorm with the residual add, SiLU-and-multiply, RoPE;
- ``forward other``: the rest of the forward (embedding, cos/sin, the KV write, the layer loop);
- ``sampling``, ``runner host``: the metadata, host-to-tensor copies and sampling around it;
- ``scheduler``: ``LLMEngine.step`` outside the model runner (schedule, complete, bookkeeping).

Prints the CPU (lscpu's model name, AMX or not) beside the figures. ``--torch-profile`` adds
torch.profiler's table of the ops by self CPU time for the last batch size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
from collections import defaultdict

import torch

from pdserve.cli.throughput import matmul_tflops, memory_gbps, model_flops_per_token, weight_bytes
from pdserve.engine import model_runner
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models import attention, kernels, linear, quant
from pdserve.engine.params import SamplingParams
from pdserve.worker.flags import non_negative_int, positive_int

WARMUP_STEPS = 3


def cpu_name() -> str:
    """lscpu's model name, and whether the CPU has AMX (bf16 tiles) or AVX-512."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    isa = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return f"{name} ({isa}, {torch.get_num_threads()} threads)"


class Timers:
    """Seconds per category, summed over the wrapped calls while ``on``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.classes_done = False

    def wrap(self, owner, name: str, category: str) -> None:
        """Replace ``owner.name`` (a function or method) with a timed call."""
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - t

        setattr(owner, name, timed)


def instrument_classes(timers: Timers, ops_cls: type) -> None:
    """Time the linear, attention and elementwise classes and sampling (once per process)."""
    classes = [*vars(linear).values(), *vars(quant).values(), kernels.DenseLinear]  # dense and quantized
    for cls in {x for x in classes if isinstance(x, type) and x.__name__.endswith("Linear")}:
        if "__call__" in vars(cls):
            timers.wrap(cls, "__call__", "linear")
    for cls in (attention.TorchAttention, attention.CpuPagedAttention):
        timers.wrap(cls, "decode", "attention")
    for name in ("add_rms_norm", "silu_mul", "rope_"):
        timers.wrap(ops_cls, name, "elementwise")
    timers.wrap(model_runner, "sample", "sampling")


def instrument_engine(engine: LLMEngine, timers: Timers) -> None:
    """Time this engine's forward, logits and runner step."""
    timers.wrap(engine.runner.model, "compute_logits", "lm_head")
    timers.wrap(engine.runner.model, "forward", "forward")
    timers.wrap(engine.runner, "run", "runner")


def decode_bound_s(engine: LLMEngine, batch: int, context: int, bandwidth: float, peak: float) -> dict[str, float]:
    """Bound seconds of one decode step's parts: weights and KV read once at ``bandwidth`` GB/s, or
    the FLOPs at ``peak`` TFLOP/s, whichever is longer."""
    mc, dtype = engine.model_cfg, engine.runner.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    head = mc.hidden_size * mc.vocab_size
    flops = model_flops_per_token(mc)
    weights = weight_bytes(mc, itemsize, engine.cfg.quantization, engine.cfg.lm_head_quantization)
    head_bytes = weights - weight_bytes(mc, itemsize, engine.cfg.quantization, "none") + head * itemsize
    kv = batch * context * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * itemsize
    return {
        "linear": max((weights - head_bytes) / bandwidth / 1e9, batch * (flops - 2 * head) / peak / 1e12),
        "lm_head": max(head_bytes / bandwidth / 1e9, batch * 2 * head / peak / 1e12),
        "attention": kv / bandwidth / 1e9,
    }


def profile_batch(args, batch: int, bandwidth: float, timers: Timers, torch_profile: bool) -> None:
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=batch,
        num_kv_blocks=batch * (-(-(args.context + args.steps + 16) // 16)) + 8,
        enable_prefix_caching=False,
        torch_threads=args.threads,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
    )
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.steps + WARMUP_STEPS + 4, ignore_eos=True)
    window = engine.model_cfg.max_position_embeddings
    if args.context + sampling.max_tokens > window:
        raise ValueError(
            f"--context {args.context} and --steps {args.steps} (+ {WARMUP_STEPS + 4} warm-up tokens) exceed the "
            f"model's context window of {window} tokens"
        )
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(engine.model_cfg.vocab_size) for _ in range(args.context)], sampling)
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()
    instrument_engine(engine, timers)
    if not timers.classes_done:
        instrument_classes(timers, type(engine.runner.model.ops))
        timers.classes_done = True
    timers.seconds.clear()
    for _ in range(WARMUP_STEPS):
        engine.step()
    stack = getattr(engine.runner.model, "stack", None)
    stack_calls = stack.calls if stack is not None else 0
    walls = []
    timers.on = True
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    timers.on = False
    peak = matmul_tflops(
        batch,
        engine.model_cfg.hidden_size,
        engine.model_cfg.intermediate_size,
        engine.runner.dtype,
        engine.runner.device,
    )
    bound = decode_bound_s(engine, batch, args.context + args.steps // 2, bandwidth, peak)
    stacked = stack is not None and stack.calls > stack_calls
    report(batch, walls, timers.seconds, bound, args.steps, peak, stacked)
    if torch_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def report(
    batch: int, walls: list[float], seconds: dict[str, float], bound: dict[str, float], steps: int, peak, stacked: bool
):
    """One batch's table. ``stacked``: the steps ran the decoder stack (every layer in one C++ call),
    whose linears, attention and elementwise ops no Python wrapper sees, so they share one row."""
    s = defaultdict(float, {k: v / steps * 1e3 for k, v in seconds.items()})  # ms per step
    s["linear"] -= s["lm_head"]  # lm_head is one of the engine's linears too
    step = statistics.median(walls) * 1e3
    mean = sum(walls) / len(walls) * 1e3
    total_bound = sum(bound.values()) * 1e3
    forward_other = s["forward"] - s["linear"] - s["attention"] - s["elementwise"]
    rows = [
        ("linear", s["linear"], bound["linear"] * 1e3),
        ("lm_head", s["lm_head"], bound["lm_head"] * 1e3),
        ("attention", s["attention"], bound["attention"] * 1e3),
        ("elementwise", s["elementwise"], 0.0),
        ("forward other", forward_other, 0.0),
        ("sampling", s["sampling"], 0.0),
        ("runner host", s["runner"] - s["forward"] - s["lm_head"] - s["sampling"], 0.0),
        ("scheduler", mean - s["runner"], 0.0),
    ]
    if stacked:
        layers = ("layers (stack)", s["forward"], (bound["linear"] + bound["attention"]) * 1e3)
        rows = [layers, *(r for r in rows if r[0] not in ("linear", "attention", "elementwise", "forward other"))]
    print(
        f"\nbatch {batch}: step {step:.2f} ms median ({mean:.2f} mean), bound {total_bound:.2f} ms "
        f"= {total_bound / step:.0%} of the bound; GEMM probe {peak * 1e3:.0f} GFLOP/s at {batch} rows"
    )
    print(f"  {'part':<14}{'ms/step':>9}{'share':>8}{'bound ms':>10}{'at bound':>10}")
    for name, ms, b in rows:
        at = f"{b / ms:.0%}" if b and ms > 0 else "-"
        print(f"  {name:<14}{ms:9.3f}{ms / mean:8.0%}{b:10.3f}{at:>10}")
    if stacked:
        print(
            "  layers (stack): the decoder stack runs every layer in one C++ call (its linears, attention, "
            "elementwise ops and the KV write); PDSERVE_DECODER_STACK=0 runs the layer loop, each part timed"
        )


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """The flags that pick the engine's kernels for an A/B: ``--linear-kernel``, ``--amx-attention``."""
    p.add_argument(
        "--linear-kernel",
        default="auto",
        choices=["auto", "onednn", "dense"],
        help="dense linears: the engine's choice (auto), oneDNN's GEMM even where pdserve's kernels run (onednn), "
        "or pdserve's AVX-512 kernel alone, without AMX tiles (dense)",
    )
    p.add_argument(
        "--amx-attention",
        default="on",
        choices=["on", "off"],
        help="bfloat16 paged attention on AMX tiles where the CPU has them (on, the engine's choice), or never",
    )


def use_kernels(args: argparse.Namespace) -> str:
    """Make the engine take the kernels ``add_kernel_flags``'s flags name; their description."""
    if args.linear_kernel == "onednn":
        linear.dense_linear = lambda weight, bias: None
    elif args.linear_kernel == "dense":
        kernels.has_amx = lambda: False
    if args.amx_attention == "off":
        try:
            kernels.load_cpu_kernels().pdserve_set_amx_attention(0)
        except kernels.KernelUnavailable:
            pass
    amx = args.amx_attention if getattr(args, "dtype", "bfloat16") in ("bfloat16", "auto") else "n/a (bfloat16 only)"
    if amx == "on" and not kernels.has_amx():
        amx = "on where the CPU has AMX (this one has none)"
    return f"linear kernel {args.linear_kernel}, AMX attention {amx}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:llama-80m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=positive_int, default=256, help="prompt tokens per sequence")
    p.add_argument("--steps", type=positive_int, default=30, help="decode steps timed per batch size")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"], help="as pdserve's")
    p.add_argument("--lm-head-quantization", default="none", choices=["none", "int8", "int4"], help="as pdserve's")
    add_kernel_flags(p)
    p.add_argument("--torch-profile", action="store_true", help="torch.profiler table for the last batch size")
    p.add_argument("--top", type=int, default=15, help="rows of the torch.profiler table")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = use_kernels(args)
    bandwidth = memory_gbps(torch.device("cpu"))
    print(
        f"CPU: {cpu_name()}; read probe {bandwidth:.1f} GB/s; model {args.model}, {args.dtype}, context {args.context}"
        f"; {chosen}"
    )
    timers = Timers()
    for i, batch in enumerate(args.batch):
        try:
            profile_batch(args, batch, bandwidth, timers, args.torch_profile and i == len(args.batch) - 1)
        except (ValueError, FileNotFoundError) as exc:  # a model or a context the engine refuses
            p.error(str(exc))


if __name__ == "__main__":
    main()
