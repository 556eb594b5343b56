"""OpenAI's response objects from pdserve's messages: completions and chat completions, whole or
streamed as chunks, usage, error objects, and the ``pdserve`` timings extension.

Reference: the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``, error objects).
"""

from __future__ import annotations

import time
from typing import Literal

from pdserve.v1 import generate_pb2

PB = generate_pb2

FINISH_REASONS = {
    PB.FINISH_REASON_STOP: "stop",
    PB.FINISH_REASON_LENGTH: "length",
    PB.FINISH_REASON_ABORT: "abort",
    PB.FINISH_REASON_ERROR: "error",
}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        409: "ConflictError",
        413: "BadRequestError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
        504: "TimeoutError",
    }.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def timings_json(t: PB.Timings) -> dict:
    """The ``pdserve`` extension: the request's phases, in seconds (bytes for the KV transfer), and
    the gRPC Timings' other fields: whether the decode worker prefilled it, its prompt tokens taken
    from a prefix cache, its preemptions; waits (``router_queue_s``, ``kv_admission_s``,
    ``preempted_s``) are parts of the phases."""
    return {
        "queue_s": t.queue_ns / 1e9,
        "prefill_s": t.prefill_ns / 1e9,
        "kv_transfer_s": t.kv_transfer_ns / 1e9,
        "kv_transfer_bytes": t.kv_transfer_bytes,
        "decode_s": t.decode_ns / 1e9,
        "total_s": t.total_ns / 1e9,
        "prefilled_on_decode": t.prefilled_on_decode,
        "cached_prompt_tokens": t.cached_prompt_tokens,
        "router_queue_s": t.router_queue_ns / 1e9,
        "kv_admission_s": t.kv_admission_ns / 1e9,
        "num_preemptions": t.num_preemptions,
        "preempted_s": t.preempted_ns / 1e9,
    }


def usage_json(u: PB.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class ResponseShape:
    """Builds one request's response objects for ``kind`` "completion" or "chat"."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str) -> None:
        self.kind, self.model, self.created = kind, model, int(time.time())
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + request_id

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str, finish: int, usage: PB.Usage, timings: PB.Timings) -> dict:
        reason = FINISH_REASONS.get(finish)
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._envelope("text_completion", [choice])
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            body = self._envelope("chat.completion", [choice])
        return {**body, "usage": usage_json(usage), "pdserve": timings_json(timings)}

    def delta(self, text: str, finish: int | None = None, first: bool = False) -> dict | None:
        """One streamed chunk, or None when it would carry nothing: no text (the bytes of a character,
        or text that may become a stop string, held back), no finish reason, and not chat's first
        chunk, which carries the role."""
        reason = FINISH_REASONS.get(finish) if finish else None
        if not text and reason is None and not (first and self.kind == "chat"):
            return None
        if self.kind == "completion":
            return self._envelope(
                "text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            )
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return self._envelope(
            "chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
        )

    def usage_chunk(self, usage: PB.Usage) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {**self._envelope(obj, []), "usage": usage_json(usage)}
