"""Turns a client GenerateRequest into prompt ids and resolved sampling, or a readable error."""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.params import sampling_errors
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2, worker_pb2

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_CHARS = 256  # request ids travel in every worker call, log line and abort


class InvalidRequest(ValueError):
    """The request can never be served as sent; the message says why (maps to INVALID_ARGUMENT)."""


@dataclass
class ValidatedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: worker_pb2.ResolvedSampling
    stop: list[str]


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling values the model's ``generation_config.json`` sets (temperature, top_p, top_k):
    what a request that leaves them unset gets, as in vLLM (``--generation-config auto``)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: cfg[k] for k in SAMPLING_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}


def check_text_fits(text: str, tokenizer: Tokenizer, max_model_len: int) -> None:
    """InvalidRequest, without tokenizing, when ``text`` has too many bytes to fit the context
    window: tokenizing megabytes holds the GIL for seconds, and every other request with it.
    The bound is ``Tokenizer.max_token_bytes``, with 2x slack for normalizers that shrink text."""
    at_least = len(text.encode("utf-8", "surrogatepass")) // (2 * tokenizer.max_token_bytes)
    if at_least >= max_model_len:
        raise InvalidRequest(f"prompt has at least {at_least} tokens ({len(text)} characters); the context "
                             f"window is {max_model_len} tokens (prompt + max_tokens must fit)")


def validate(req: generate_pb2.GenerateRequest, tokenizer: Tokenizer, max_model_len: int,
             vocab_size: int, defaults: dict[str, float] | None = None) -> ValidatedRequest:
    """Tokenize and resolve defaults: a sampling field left unset takes ``defaults`` (the model's
    generation_config.json, see ``sampling_defaults``), else temperature 1, top_p 1, top_k 0.
    Raises InvalidRequest listing every problem found."""
    defaults = defaults or {}
    errors: list[str] = []
    if req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            errors.append(f"prompt token ids out of range: each must be in [0, {vocab_size}), got {bad[:5]}")
    elif req.prompt:
        check_text_fits(req.prompt, tokenizer, max_model_len)
        ids = tokenizer.encode(req.prompt)
    else:
        ids = []
    if not ids:
        errors.append("prompt is empty: send a non-empty prompt (text or token ids)")
    n = len(ids)
    if n >= max_model_len:
        errors.append(f"prompt has {n} tokens; the context window is {max_model_len} tokens "
                      f"(prompt + max_tokens must fit)")
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens >= 1 and n < max_model_len and n + max_tokens > max_model_len:
            errors.append(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                          f"the context window of {max_model_len} tokens")
    else:
        max_tokens = max(1, max_model_len - n)
    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else float(defaults.get("temperature", 1.0))
    top_p = s.top_p if s.HasField("top_p") else float(defaults.get("top_p", 1.0))
    top_k = s.top_k if s.HasField("top_k") else int(defaults.get("top_k", 0))
    if math.isnan(temperature) or math.isnan(top_p):
        errors.append("temperature and top_p must be numbers, got NaN")
    else:
        errors += sampling_errors(temperature, top_p, top_k, max_tokens)
    stop = list(req.stop)
    if len(stop) > MAX_STOP_STRINGS:
        errors.append(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not x for x in stop):
        errors.append("stop strings must be non-empty")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        errors.append(f"request_id has {len(req.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if errors:
        raise InvalidRequest("; ".join(errors))
    seed = s.seed if s.HasField("seed") else (0 if temperature == 0 else secrets.randbits(63))
    sampling = worker_pb2.ResolvedSampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                           max_tokens=max_tokens, ignore_eos=req.ignore_eos)
    return ValidatedRequest(req.request_id or uuid.uuid4().hex, ids, sampling, stop)
