"""Frozen configuration objects for the model and the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
KV_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None = None  # each query attends to at most this many latest positions (Mistral, Qwen2)
    torch_dtype: str = "float32"  # the checkpoint's dtype (config.json ``dtype`` / ``torch_dtype``)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises FileNotFoundError when it is missing and ValueError for an architecture other than
        Llama, Mistral or Qwen2, an activation other than SiLU or an unsupported RoPE scaling.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json`` (see ``from_folder`` for errors)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the forward pass hard-codes SiLU (swish is its other name)
            raise ValueError(f"unsupported hidden_act {act!r}; supported: silu")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):  # transformers >= 5 layout
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
            if kind == "default":
                rope_scaling = None
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=_sliding_window(cfg, arch),
            torch_dtype=_checkpoint_dtype(cfg),
        )


def _checkpoint_dtype(cfg: dict[str, Any]) -> str:
    """The checkpoint's dtype name; float32 when unset or not one pdserve runs (transformers' default)."""
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in KV_DTYPES else "float32"


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """Window size when the checkpoint uses sliding-window attention (Qwen2 only with use_sliding_window)."""
    window = cfg.get("sliding_window")
    if not window or (arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


# Step token budgets by worker role when --max-num-batched-tokens is not given. Prefill workers
# decode nothing: 2048 tokens a step keeps their throughput close to whole-prompt batches while a
# long prompt still cannot hold short ones back by more than one step. A colocated worker
# interleaves decode, so each step is an inter-token gap of every decoding sequence, and a fixed
# token count is the wrong unit (the same chunk costs ten times more on some CPUs than on others).
# Unless a budget is given, it sizes chunks to DEFAULT_TARGET_ITL_MS instead (StepTimeModel),
# within 2048 tokens. The target is a reading-speed token rate (5 tokens/s); DistServe's chat TPOT
# SLOs are 0.1-0.2 s.
DEFAULT_TOKEN_BUDGET = {"colocated": 2048, "prefill": 2048, "decode": 2048}
DEFAULT_TARGET_ITL_MS = {"colocated": 200.0}
UNCHUNKED_TOKEN_BUDGET = 4096


def describe_scheduling(cfg: EngineConfig) -> str:
    """One line saying how ``cfg`` schedules steps (logged when an engine starts)."""
    if not cfg.enable_chunked_prefill:
        return f"prefill-first, up to {cfg.token_budget} prompt tokens a prefill step"
    if cfg.target_itl_ms is None:
        return f"chunked prefill, {cfg.token_budget} tokens a step"
    return f"chunked prefill, chunks sized to {cfg.target_itl_ms:g} ms steps, at most {cfg.token_budget} tokens a step"


def for_role(cfg: EngineConfig, role: str) -> EngineConfig:
    """``cfg`` with ``role``'s defaults where it sets none: without chunked prefill, a batch of
    whole prompts up to ``UNCHUNKED_TOKEN_BUDGET`` tokens; with it, ``DEFAULT_TOKEN_BUDGET[role]`` and,
    unless a token budget was given (vLLM's rule exactly), ``DEFAULT_TARGET_ITL_MS[role]``."""
    from dataclasses import replace

    if cfg.max_num_batched_tokens is not None:
        return cfg
    if not cfg.enable_chunked_prefill:
        return replace(cfg, max_num_batched_tokens=UNCHUNKED_TOKEN_BUDGET)
    target = cfg.target_itl_ms if cfg.target_itl_ms is not None else DEFAULT_TARGET_ITL_MS.get(role)
    return replace(cfg, max_num_batched_tokens=DEFAULT_TOKEN_BUDGET[role], target_itl_ms=target)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings shared by every role.

    ``num_kv_blocks`` is the size of the paged KV cache in blocks of ``block_size`` tokens; when
    None it is derived from ``kv_cache_gib`` (GiB of KV memory). ``max_num_batched_tokens`` is the
    token budget of one step (with ``enable_chunked_prefill``, prompts are cut into chunks to fit it
    beside the decoding sequences; without, it bounds a prefill batch of whole prompts);
    ``max_num_seqs`` bounds the sequences of any step. ``enable_prefix_caching`` keeps full KV
    blocks for reuse by later requests with the same prefix.
    ``torch_threads`` (CPU only) sets ``torch.set_num_threads`` for the worker process.
    """

    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_gib: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the role's default (``for_role``), 2048 outside a cluster
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    torch_threads: int | None = None
    attention_backend: str = "auto"
    target_itl_ms: float | None = None  # chunked prefill: size each step's prompt chunk to this step time

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute (``max_num_batched_tokens``, 2048 when unset)."""
        return DEFAULT_TOKEN_BUDGET["prefill"] if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"dtype must be auto or one of {KV_DTYPES}, got {self.dtype!r}")
        if self.max_num_seqs < 1 or self.token_budget < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.target_itl_ms is not None and not 0 < self.target_itl_ms < float("inf"):
            raise ValueError(f"target_itl_ms must be a finite number > 0, got {self.target_itl_ms}")
        if self.target_itl_ms is not None and not self.enable_chunked_prefill:
            raise ValueError(
                "--target-itl-ms sizes prefill chunks, so it needs chunked prefill; "
                "drop --no-chunked-prefill or --target-itl-ms"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
