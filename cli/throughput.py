"""``pdserve throughput``: offline generation on one engine, beside the bound this machine allows.

The workload is vLLM's ``benchmark_throughput`` with random prompts: ``num_prompts`` prompts of
``input_len`` random token ids, ``output_len`` greedy tokens each, EOS ignored, all submitted at
once. Total tok/s counts prompt and output tokens over the wall time of the whole run.

The bound is measured in the same process: a GEMM probe (the engine's own linear layer at the
prefill's row count) gives the matmul peak, a read probe gives memory bandwidth. Prefill's bound
is its FLOPs at that peak; a decode step's bound is the larger of reading every weight and the KV
cache once at that bandwidth and its FLOPs at the GEMM rate measured at the batch's row count.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.linear import make_linear
from pdserve.engine.params import SamplingParams


@dataclass
class ThroughputResult:
    """Figures of one run; ``*_fraction`` = bound time / measured time (1.0 = at the bound)."""

    model: str
    dtype: str
    dtype_reason: str
    attention_backend: str
    quantization: str  # of the decoder layers' weights: none, int8 or int4
    lm_head_quantization: str  # of lm_head's weight
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    total_tokens_per_s: float
    output_tokens_per_s: float
    prefill_tokens_per_s: float
    prefill_s: float
    decode_batch: int  # the largest decode batch the run reached (num_prompts unless capped)
    decode_step_ms: float  # median step at that batch
    matmul_tflops: float  # GEMM probe at the prefill row count
    matmul_tflops_decode: float  # GEMM probe at the decode row count
    memory_gbps: float
    prefill_bound_s: float
    decode_step_bound_ms: float
    total_bound_s: float
    prefill_fraction: float
    decode_fraction: float
    total_fraction: float

    def to_dict(self) -> dict:
        return asdict(self)


def _best_time(fn, device: torch.device, repeat: int = 5) -> float:
    """Fastest of ``repeat`` timed calls (after one warm-up), seconds; waits for the GPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_tflops(rows: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> float:
    """TFLOP/s of the engine's linear layer on x [rows, k] @ w [n, k].T."""
    lin = make_linear(torch.randn(n, k, dtype=dtype, device=device))
    x = torch.randn(rows, k, dtype=dtype, device=device)
    seconds = _best_time(lambda: lin(x), device, repeat=5 if rows <= 256 else 3)
    return 2 * rows * k * n / seconds / 1e12


def memory_gbps(device: torch.device, nbytes: int = 1 << 29) -> float:
    """Read bandwidth in GB/s: a float32 sum over ``nbytes`` (far larger than the caches)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = _best_time(lambda: x.sum(), device)
    return nbytes / seconds / 1e9


def model_flops_per_token(mc: ModelConfig) -> int:
    """2 x the weights every token multiplies: q|k|v, o, gate|up, down per layer (in a layer of routed
    experts: the router and ``num_experts_per_tok`` experts' gate|up, down), plus lm_head."""
    d, h = mc.head_dim, mc.hidden_size
    attention = h * (mc.num_heads + 2 * mc.num_kv_heads) * d + mc.num_heads * d * h
    moe = len(mc.moe_layers)
    mlp = (mc.num_layers - moe) * 3 * h * mc.intermediate_size
    mlp += moe * h * (mc.num_experts + 3 * mc.num_experts_per_tok * mc.moe_intermediate_size)
    return 2 * (mc.num_layers * attention + mlp + h * mc.vocab_size)


# bytes a decode step reads per decoder-layer weight under --quantization: int8 (per-channel scales
# are negligible), int4 (half a byte plus a scale and a zero of 2 bytes each per group of 32)
QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 32}


def weight_bytes(mc: ModelConfig, itemsize: int, quantization: str = "none", lm_head: str = "none") -> int:
    """Bytes a decode step reads for weights (embedding rows are negligible): the decoder layers'
    linears and lm_head, each at ``QUANTIZED_BYTES`` a weight under its scheme, else ``itemsize``."""
    head = mc.hidden_size * mc.vocab_size
    layers = model_flops_per_token(mc) // 2 - head
    return int(layers * QUANTIZED_BYTES.get(quantization, itemsize) + head * QUANTIZED_BYTES.get(lm_head, itemsize))


def run_throughput(
    cfg: EngineConfig, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> ThroughputResult:
    """Run the workload once after a short warm-up; ValueError for lengths the model cannot hold."""
    if output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (a decode step is measured), got {output_len}")
    engine = LLMEngine(cfg)
    mc, runner = engine.model_cfg, engine.runner
    rng = random.Random(seed)
    prompts = [[rng.randrange(mc.vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    engine.check_request(prompts[0], SamplingParams(max_tokens=output_len))  # every prompt has this length
    engine.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"throughput-{i}", p, sampling)
    # A step that computes prompt tokens counts as prefill time, also when it decodes other
    # sequences beside a chunk (chunked prefill); pure decode steps by their batch size.
    prefill_s, decode_steps = 0.0, {}
    sched = engine.scheduler
    start = time.perf_counter()
    while engine.has_work():
        prefilling = bool(sched.waiting) or not all(s.is_decoding for s in sched.running)
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        if prefilling:
            prefill_s += dt
        elif outputs:
            decode_steps.setdefault(len(outputs), []).append(dt)
    elapsed = time.perf_counter() - start
    batch = max(decode_steps)

    dtype, device = runner.dtype, runner.device
    itemsize = torch.empty((), dtype=dtype).element_size()
    peak = matmul_tflops(min(2048, num_prompts * input_len), mc.hidden_size, mc.intermediate_size, dtype, device)
    peak_decode = matmul_tflops(batch, mc.hidden_size, mc.intermediate_size, dtype, device)
    bandwidth = memory_gbps(device)

    attn_flops = 2 * mc.num_layers * mc.num_heads * mc.head_dim * input_len * input_len  # causal QK^T + PV
    head_flops = 2 * mc.hidden_size * mc.vocab_size  # lm_head runs on each prompt's last position only
    prefill_flops = input_len * (model_flops_per_token(mc) - head_flops) + head_flops + attn_flops
    prefill_bound = num_prompts * prefill_flops / (peak * 1e12)
    mean_ctx = input_len + output_len / 2
    kv_bytes = batch * mean_ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * itemsize
    step_bound = max(
        (weight_bytes(mc, itemsize, cfg.quantization, cfg.lm_head_quantization) + kv_bytes) / (bandwidth * 1e9),
        batch * model_flops_per_token(mc) / (peak_decode * 1e12),
    )
    total_bound = prefill_bound + (output_len - 1) * num_prompts / batch * step_bound
    step = statistics.median(decode_steps[batch])
    tokens = num_prompts * (input_len + output_len)
    return ThroughputResult(
        model=cfg.model,
        dtype=runner.dtype_name,
        dtype_reason=runner.dtype_reason,
        attention_backend=runner.model.attention.name,
        quantization=cfg.quantization,
        lm_head_quantization=cfg.lm_head_quantization,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        elapsed_s=elapsed,
        total_tokens_per_s=tokens / elapsed,
        output_tokens_per_s=num_prompts * output_len / elapsed,
        prefill_tokens_per_s=num_prompts * input_len / prefill_s,
        prefill_s=prefill_s,
        decode_batch=batch,
        decode_step_ms=step * 1e3,
        matmul_tflops=peak,
        matmul_tflops_decode=peak_decode,
        memory_gbps=bandwidth,
        prefill_bound_s=prefill_bound,
        decode_step_bound_ms=step_bound * 1e3,
        total_bound_s=total_bound,
        prefill_fraction=prefill_bound / prefill_s,
        decode_fraction=step_bound / step,
        total_fraction=total_bound / elapsed,
    )


def median_decode_step_ms(engine: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Prefill ``prompts`` (greedy, EOS ignored), then the median wall time in ms of the ``steps``
    decode steps that run the whole batch."""
    for i, p in enumerate(prompts):
        engine.add_request(
            f"step-{len(prompts)}-{i}", p, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        )
    while engine.scheduler.waiting:
        engine.step()
    times = []
    while engine.has_work():
        t = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == len(prompts):
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def format_result(r: ThroughputResult) -> str:
    """The human-readable report."""
    return "\n".join(
        [
            f"model {r.model}  dtype {r.dtype} ({r.dtype_reason})  attention {r.attention_backend}"
            + (f"  quantization {r.quantization}" if r.quantization != "none" else "")
            + (f"  lm_head {r.lm_head_quantization}" if r.lm_head_quantization != "none" else ""),
            f"{r.num_prompts} prompts x {r.input_len} random tokens in -> {r.output_len} greedy tokens out, "
            "EOS ignored",
            f"total     {r.total_tokens_per_s:9.0f} tok/s   ({r.elapsed_s:.2f} s; bound {r.total_bound_s:.2f} s, "
            f"{r.total_fraction:.0%} of it)",
            f"output    {r.output_tokens_per_s:9.0f} tok/s",
            f"prefill   {r.prefill_tokens_per_s:9.0f} tok/s   ({r.prefill_s:.2f} s; bound {r.prefill_bound_s:.2f} s, "
            f"{r.prefill_fraction:.0%})",
            f"decode    {r.decode_step_ms:9.2f} ms/step at batch {r.decode_batch}   "
            f"(bound {r.decode_step_bound_ms:.2f} ms, {r.decode_fraction:.0%})",
            f"probes    matmul {r.matmul_tflops * 1e3:.3g} GFLOP/s at prefill rows, "
            f"{r.matmul_tflops_decode * 1e3:.3g} at {r.decode_batch} rows; memory read {r.memory_gbps:.3g} GB/s",
            *([past_bound_warning(r)] if max(r.prefill_fraction, r.decode_fraction, r.total_fraction) > 1 else []),
        ]
    )


def past_bound_warning(r: ThroughputResult) -> str:
    """Which figures passed their bound, and why they can: the probes ran slower than the engine
    (other work on the machine, or a run too short to time); with quantized linears also the
    bound's compute part, the model dtype's GEMM probe, which int8 dot products
    (csrc/quant_linear.cpp) can outrun."""
    fractions = {"prefill": r.prefill_fraction, "decode": r.decode_fraction, "total": r.total_fraction}
    past = ", ".join(name for name, f in fractions.items() if f > 1)
    why = "the probes were slowed by other work on this machine (or the run is too short to time)"
    if {r.quantization, r.lm_head_quantization} != {"none"}:
        why = (
            f"the bound's compute part is the {r.dtype} GEMM probe, which quantized linears can outrun "
            f"(int8 dot products on AVX512-VNNI), or {why}"
        )
    return f"warning: past its bound ({past}): {why}; rerun it on a quiet machine to tell"
