"""Frozen configuration objects for the model and the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.engine.models.gemma_config import family_fields
from pdserve.engine.models.registry import Family, architecture_of, family

KV_DTYPES = ("float32", "float16", "bfloat16")
# a prefill worker's KV hand-off: one frame after the prefill, or each layer while it runs (layer_stream.py)
KV_STREAMS = ("whole", "layer")
# over TCP, the lower median TTFT of split placement under load on 2 CPU cores (docs/measurements.md)
DEFAULT_KV_STREAM = "whole"
KV_TRANSPORTS = ("tcp", "grpc")  # tcp: several times gRPC's bytes per second on loopback (docs/measurements.md)
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, of the decoder's linears (engine/models/quant.py)
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of the families in ``pdserve.engine.models.registry``, read from a
    Hugging Face ``config.json`` (the ``text_config`` inside it, when there is one).

    ``layer_windows`` holds each layer's sliding window (None: full attention); ``sliding_window`` is
    the window when any layer has one. Mixture-of-experts models route each token to
    ``num_experts_per_tok`` of ``num_experts`` gated MLPs of ``moe_intermediate_size`` in the layers
    ``moe_layers`` (the others have a dense MLP of ``intermediate_size``)."""

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
    sliding_window: int | None = None  # each query attends to at most this many latest positions
    torch_dtype: str = "float32"  # the checkpoint's dtype (config.json ``dtype`` / ``torch_dtype``)
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    moe_layers: tuple[int, ...] = ()
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * this dims of each head (Phi-4-mini)
    # Gemma (``pdserve.engine.models.gemma_config``): the gated MLP's activation, the attention scale
    # (None: head_dim ** -0.5), tanh soft-caps of the attention scores and of the final logits
    # (None: none), and the RoPE base of the sliding-window layers (None: rope_theta, scaled as the rest)
    hidden_act: str = "silu"
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None

    @property
    def kv_window(self) -> int | None:
        """Positions of KV a query can still need when every layer has a sliding window (the
        largest of them), else None: positions further back than this from the next query are
        never read, so their blocks can be freed (``BlockManager.free_outside_window``). A model
        with any full-attention layer (Gemma's global layers) keeps every block."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``folder/config.json``.

        Raises FileNotFoundError when it is missing and ValueError for an architecture pdserve does
        not run (the message lists those it does), an activation its family lacks or an unsupported
        RoPE scaling.
        """
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json`` (see ``from_folder`` for errors; also ValueError when
        ``architectures`` is not a list of names, when it is absent and ``model_type`` names no
        supported family, or when a field the model needs is missing)."""
        arch = architecture_of(raw)
        if not isinstance(arch, str):
            raise ValueError(f"config.json: 'architectures' must be a list of names, got {raw['architectures']!r}")
        try:
            return cls._from_dict(raw, arch)
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc.args[0]!r}, which a {arch} model needs") from None

    @classmethod
    def _from_dict(cls, raw: dict[str, Any], arch: str) -> ModelConfig:
        fam = family(arch)
        cfg = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
        cfg, own = family_fields(cfg, fam)  # the activation; Gemma's scale, soft-caps, layer types, RoPE bases
        rope_theta, rope_scaling = _rope(cfg, fam)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        windows = _layer_windows(cfg, fam, num_layers)
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            attention_bias=bool(cfg.get("attention_bias", fam.qkv_bias)),
            sliding_window=max((w for w in windows if w is not None), default=None),
            torch_dtype=_checkpoint_dtype(cfg),
            layer_windows=windows,
            qk_norm=fam.qk_norm,
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if fam.norm_topk_prob is None else fam.norm_topk_prob,
            moe_layers=tuple(i for i in range(num_layers) if num_experts and i not in dense and (i + 1) % step == 0),
            partial_rotary_factor=float(
                (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                or cfg.get("partial_rotary_factor")
                or 1.0
            ),
            **own,
        )


def _rope(cfg: dict[str, Any], fam: Family) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling parameters or None) from ``rope_parameters`` (transformers >= 5) or the
    older ``rope_scaling`` and top-level ``rope_theta``; ValueError for a scaling pdserve lacks.
    The family's ``longrope_aliases`` become ``rope_type`` "longrope"."""
    rope_scaling = cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind in fam.longrope_aliases:
            kind, rope_scaling = "longrope", {**rope_scaling, "rope_type": "longrope"}
        if kind == "dynamic":
            raise ValueError(
                "unsupported rope scaling 'dynamic': its frequencies follow each sequence's length, so keys "
                f"cached earlier would not match; supported: {', '.join(ROPE_TYPES)}"
            )
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
        if kind == "default":
            rope_scaling = None
        elif kind in ("llama3", "yarn", "longrope"):  # transformers' standardize_rope_params
            old = cfg.get("original_max_position_embeddings")
            fallback = rope_scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": old or fallback}
    return float(rope_theta if rope_theta is not None else 10000.0), rope_scaling


def _checkpoint_dtype(cfg: dict[str, Any]) -> str:
    """The checkpoint's dtype name; float32 when unset or not one pdserve runs (transformers' default)."""
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in KV_DTYPES else "float32"


def _layer_windows(cfg: dict[str, Any], fam: Family, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies ``sliding_window`` for the family."""
    window = cfg.get("sliding_window")
    if not window or (fam.window_flag and not cfg.get("use_sliding_window", False)):
        return (None,) * num_layers
    if not fam.layer_types:
        return (int(window),) * num_layers
    types = cfg.get("layer_types")
    if not types:
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return tuple(int(window) if t == "sliding_attention" else None for t in types[:num_layers])


# Step token budgets by worker role when --max-num-batched-tokens is not given: 2048 tokens a step
# (vLLM's rule) keeps prefill throughput close to whole-prompt batches while a long prompt cannot
# hold short ones back by more than one step. A step target in time (--target-itl-ms,
# StepTimeModel) bounds the gaps of the sequences decoding beside a prompt more tightly, but only by
# cutting prompts into chunks that each pay the step's decode rows and fixed cost again: on an AVX2
# core in float32 a 200 ms target left about 25 prompt tokens a step, and two colocated workers
# serving W2 at 0.9 req/s met the SLO for 39 % of requests against 90 % without it
# (docs/measurements.md). Goodput counts a request's mean TPOT, which chunking does not lower (the
# same prompt work lands in its lifetime either way), so no role sets a target unless asked.
DEFAULT_TOKEN_BUDGET = {"colocated": 2048, "prefill": 2048, "decode": 2048}
UNCHUNKED_TOKEN_BUDGET = 4096


def describe_scheduling(cfg: EngineConfig) -> str:
    """One line saying how ``cfg`` schedules steps (logged when an engine starts)."""
    if not cfg.enable_chunked_prefill:
        return f"prefill-first, up to {cfg.token_budget} prompt tokens a prefill step"
    if cfg.target_itl_ms is None:
        return f"chunked prefill, {cfg.token_budget} tokens a step"
    return f"chunked prefill, chunks sized to {cfg.target_itl_ms:g} ms steps, at most {cfg.token_budget} tokens a step"


def for_role(cfg: EngineConfig, role: str) -> EngineConfig:
    """``cfg`` with ``role``'s default token budget where it sets none: without chunked prefill, a
    batch of whole prompts up to ``UNCHUNKED_TOKEN_BUDGET`` tokens; with it,
    ``DEFAULT_TOKEN_BUDGET[role]`` (``--target-itl-ms``, when given, still sizes chunks within it)."""
    if cfg.max_num_batched_tokens is not None:
        return cfg
    if not cfg.enable_chunked_prefill:
        return replace(cfg, max_num_batched_tokens=UNCHUNKED_TOKEN_BUDGET)
    return replace(cfg, max_num_batched_tokens=DEFAULT_TOKEN_BUDGET[role])


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings shared by every role.

    ``num_kv_blocks``: the paged KV cache's size in blocks of ``block_size`` tokens of every layer
    (None: from ``kv_cache_gib``, GiB; a hybrid model's pool counts ``kv_pool_blocks``' group blocks).
    ``max_num_batched_tokens``: the token budget of one step (with ``enable_chunked_prefill`` prompts
    are cut into chunks to fit it beside the decoding sequences; without, it bounds a batch of whole
    prompts); ``max_num_seqs`` bounds the sequences of a step.
    ``enable_prefix_caching`` keeps full KV blocks for later requests with the same prefix.
    ``torch_threads`` (CPU only): ``torch.set_num_threads`` for the worker process.
    ``quantization`` / ``lm_head_quantization`` ("none", "int8" or "int4"): the decoder layers'
    linears' / lm_head's weights (``pdserve.engine.models.quant``); the KV cache stays in ``dtype``.
    ``kv_stream`` (a prefill worker's): its KV goes to decode as one frame after the prefill
    ("whole") or layer by layer while it runs ("layer"), over ``kv_transport``: "tcp", the decode
    worker's KV data connection (``pdserve.engine.kv.tcp_wire``), or "grpc", its PushKv (always the
    way to a worker that offers no KV port). ``enforce_eager``: on CUDA, decode steps
    op by op instead of replayed CUDA graphs (``pdserve.engine.decode_graphs``).
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
    quantization: str = "none"
    lm_head_quantization: str = "none"
    kv_stream: str = DEFAULT_KV_STREAM
    kv_transport: str = "tcp"
    enforce_eager: bool = False

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute (``max_num_batched_tokens``, 2048 when unset)."""
        return DEFAULT_TOKEN_BUDGET["prefill"] if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"dtype must be auto or one of {KV_DTYPES}, got {self.dtype!r}")
        choices = {"kv_stream": KV_STREAMS, "kv_transport": KV_TRANSPORTS}
        for name, allowed in (choices | dict.fromkeys(("quantization", "lm_head_quantization"), QUANTIZATIONS)).items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
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
