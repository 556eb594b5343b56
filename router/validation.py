"""Turns a client GenerateRequest into prompt ids and resolved sampling, or a readable error."""

from __future__ import annotations

import json
import math
import secrets
import unicodedata
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.params import sampling_field_errors
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2, worker_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # per stop string: text that may become one is held back, and matched on every chunk
MAX_REQUEST_ID_CHARS = 256  # request ids travel in every worker call, log line and abort
TOP_K_ALLOWED = ">= -1 (-1 or 0 disables)"  # top_k as every client API takes it, vLLM's -1 included


class InvalidRequest(ValueError):
    """The request can never be served as sent; the message says why (maps to INVALID_ARGUMENT).
    ``param`` names the field at fault as the client sent it (the first one when several are),
    None when no single field is (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
        raise InvalidRequest(
            f"prompt has at least {at_least} tokens ({len(text)} characters); the context "
            f"window is {max_model_len} tokens (prompt + max_tokens must fit)",
            "prompt",
        )


def request_id_errors(request_id: str) -> list[str]:
    """What is wrong with a client-chosen request id ([] when fine): ids go into log lines, so at
    most MAX_REQUEST_ID_CHARS characters and no control characters (Unicode category Cc: newline,
    tab, NUL, ESC, DEL and the like)."""
    errors = []
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        errors.append(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    bad = next((i for i, c in enumerate(request_id) if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        errors.append(
            f"request_id must not contain control characters (newline, tab, NUL and other Unicode "
            f"category Cc); found {request_id[bad]!r} at index {bad}"
        )
    return errors


def validate(
    req: generate_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    vocab_size: int,
    defaults: dict[str, float] | None = None,
    names: Mapping[str, str] | None = None,
) -> ValidatedRequest:
    """Tokenize and resolve defaults: a sampling field left unset takes ``defaults`` (the model's
    generation_config.json, see ``sampling_defaults``), else temperature 1, top_p 1, top_k 0; a
    top_k of -1 disables top-k as 0 does (vLLM's convention), and the resolved sampling carries 0.
    ``names``: what the client called a GenerateRequest field where it differs (the HTTP API's
    ``max_completion_tokens`` for ``max_tokens``, ``messages`` for ``prompt``); errors name those.
    Raises InvalidRequest listing every problem found, its ``param`` the first one's field."""
    defaults = defaults or {}
    names = names or {}
    errors: list[tuple[str | None, str]] = []  # (field, message)

    def name(field: str) -> str:
        return names.get(field, field)

    if req.prompt and req.prompt_token_ids:
        errors.append((None, "prompt and prompt_token_ids are both set; give one or the other (text or token ids)"))
    if req.prompt_token_ids:
        ids = list(req.prompt_token_ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            errors.append(
                (
                    name("prompt_token_ids"),
                    f"prompt token ids out of range: each must be in [0, {vocab_size}), got {bad[:5]}",
                )
            )
    elif req.prompt:
        check_text_fits(req.prompt, tokenizer, max_model_len)
        ids = tokenizer.encode(req.prompt)
    else:
        ids = []
    if not ids:
        errors.append((name("prompt"), "prompt is empty: send a non-empty prompt (text or token ids)"))
    n = len(ids)
    if n >= max_model_len:
        errors.append(
            (
                name("prompt"),
                f"prompt has {n} tokens; the context window is {max_model_len} tokens "
                f"(prompt + {name('max_tokens')} must fit)",
            )
        )
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens >= 1 and n < max_model_len and n + max_tokens > max_model_len:
            errors.append(
                (
                    name("max_tokens"),
                    f"prompt ({n} tokens) + {name('max_tokens')} ({max_tokens}) = "
                    f"{n + max_tokens} exceeds the context window of {max_model_len} "
                    f"tokens",
                )
            )
    else:
        max_tokens = max(1, max_model_len - n)
    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else float(defaults.get("temperature", 1.0))
    top_p = s.top_p if s.HasField("top_p") else float(defaults.get("top_p", 1.0))
    top_k = s.top_k if s.HasField("top_k") else int(defaults.get("top_k", 0))
    nan = [field for field, value in (("temperature", temperature), ("top_p", top_p)) if math.isnan(value)]
    errors += [(name(field), f"{name(field)} must be a number, got NaN") for field in nan]
    field_errors = sampling_field_errors(temperature, top_p, max(top_k, 0), max_tokens)
    if top_k < -1:  # the engine takes only 0 for "disabled"; a client may also send -1 (vLLM's)
        at = len([field for field, _ in field_errors if field != "max_tokens"])
        field_errors.insert(at, ("top_k", f"must be {TOP_K_ALLOWED}, got {top_k}"))
    errors += [(name(field), f"{name(field)} {what}") for field, what in field_errors if field not in nan]
    top_k = max(top_k, 0)
    stop = list(req.stop)
    if len(stop) > MAX_STOP_STRINGS:
        errors.append((name("stop"), f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}"))
    if any(not x for x in stop):
        errors.append((name("stop"), "stop strings must be non-empty"))
    long = [i for i, x in enumerate(stop) if len(x) > MAX_STOP_CHARS]
    if long:
        errors.append(
            (
                name("stop"),
                f"stop strings must have at most {MAX_STOP_CHARS} characters; "
                f"the one at index {long[0]} has {len(stop[long[0]])}",
            )
        )
    errors += [(name("request_id"), message) for message in request_id_errors(req.request_id)]
    if errors:
        raise InvalidRequest("; ".join(message for _, message in errors), errors[0][0])
    seed = s.seed if s.HasField("seed") else (0 if temperature == 0 else secrets.randbits(63))
    sampling = worker_pb2.ResolvedSampling(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens, ignore_eos=req.ignore_eos
    )
    return ValidatedRequest(req.request_id or uuid.uuid4().hex, ids, sampling, stop)
