"""OpenAI's completions and chat-completions shapes, to and from pdserve's GenerateRequest.

Reference: the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``, error objects)
and vLLM's extensions that load generators send (``ignore_eos``, ``top_k``). Only the request's
shape is checked here (types, ``n``, batched prompts, the bounds of integer fields: ``max_tokens``
and ``max_completion_tokens`` >= 1 both, even the one that does not apply); every other value
check (empty prompt, context window, sampling ranges, stop strings) is the router's one validator,
for HTTP and gRPC alike, whose errors name the fields as this API calls them (``field_names``).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.router.validation import TOP_K_ALLOWED
from pdserve.v1 import generate_pb2

PB = generate_pb2
UINT32_MAX, UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38  # the sampling message's floats are float32: larger finite values would read inf
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context window


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


class BadRequest(ValueError):
    """The body is not a request we can read (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


def _is_text_format(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


# field -> (is its value neutral, the neutral value as a client writes it)
UNSUPPORTED = {
    "best_of": (lambda v: v == 1 and v is not True, "1"),
    "logit_bias": (lambda v: v == {}, "{}"),
    "presence_penalty": (lambda v: v == 0 and v is not False, "0"),
    "frequency_penalty": (lambda v: v == 0 and v is not False, "0"),
    "repetition_penalty": (lambda v: v == 1 and v is not True, "1"),
    "response_format": (_is_text_format, '{"type": "text"}'),
    "tools": (lambda v: v == [], "[]"),
    "suffix": (lambda v: v == "", '""'),
}


class _Common(BaseModel):
    """Fields both endpoints take; unknown fields are ignored, as OpenAI-compatible servers do.
    Types are strict (``"5"`` is no integer, ``true`` no token id); ``null`` means the default."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=(1 << 31) - 1)  # -1 (vLLM) or 0 disables
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    logprobs: Any = None
    echo: bool | None = False
    # OpenAI (and vLLM) fields that change the output and that pdserve does not implement: refused
    # when set to anything but their neutral value (UNSUPPORTED), never silently ignored
    best_of: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    response_format: Any = None
    tools: Any = None
    suffix: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int:
        if n not in (None, 1):
            more = f"; send {n} requests for {n} choices" if n > 1 else ""
            raise ValueError(f"n must be 1 (one choice per request), got {n}{more}")
        return 1

    def _generate_request(self, **prompt) -> PB.GenerateRequest:
        if self.logprobs not in (None, False):
            raise BadRequest("logprobs are not supported", "logprobs")
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        for field, (is_neutral, neutral) in UNSUPPORTED.items():
            value = getattr(self, field)
            if value is not None and not is_neutral(value):
                raise BadRequest(
                    f"{field} is not supported by this server (it would change the output); "
                    f"leave it out or send {neutral}",
                    field,
                )
        for field in ("temperature", "top_p"):
            value = getattr(self, field)
            if value is not None and math.isfinite(value) and abs(value) > FLOAT32_MAX:
                message = f"{field} {value!r} is out of range: sampling values are float32 (at most 3.4e38)"
                raise BadRequest(message, field)
        sampling = PB.SamplingParams()
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.top_k is not None:
            sampling.top_k = max(self.top_k, 0)
        if self.seed is not None:
            sampling.seed = self.seed
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        req = PB.GenerateRequest(sampling=sampling, stop=stop, ignore_eos=bool(self.ignore_eos), **prompt)
        max_tokens = self._max_tokens()
        if max_tokens is not None:
            req.max_tokens = max_tokens
        return req

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def field_names(self) -> dict[str, str]:
        """What this API calls the GenerateRequest fields it fills (where it differs), for the
        validator's errors (``validate``'s ``names``)."""
        return {"prompt_token_ids": "prompt"}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)


class CompletionRequest(_Common):
    """``max_tokens`` defaults to 16, OpenAI's documented default for ``/v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def _max_tokens(self) -> int:
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def to_generate_request(self) -> PB.GenerateRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest(
                    f"batched prompts are not supported ({len(p)} given); send one prompt per request", "prompt"
                )
            p = p[0]
        if isinstance(p, str):
            return self._generate_request(prompt=p)
        if any(t < 0 or t > UINT32_MAX for t in p):
            raise BadRequest("prompt token ids must be non-negative integers", "prompt")
        return self._generate_request(prompt_token_ids=p)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        return role

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None:  # tool calls, the one case OpenAI allows it, are not supported
            raise ValueError(f"a {self.role} message needs content: a string or a list of text parts")
        return self

    def for_template(self) -> dict:
        """The message as templates expect it: text parts of a content list joined into one string."""
        m = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise BadRequest("only text content parts are supported", "messages")
            m["content"] = "".join(part.get("text", "") for part in self.content)
        return m


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)  # both checked when both are sent
    add_generation_prompt: bool | None = True

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_names(self) -> dict[str, str]:
        names = {"prompt": "messages", "prompt_token_ids": "messages"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def to_generate_request(self, prompt_token_ids: list[int]) -> PB.GenerateRequest:
        return self._generate_request(prompt_token_ids=prompt_token_ids)


def parse(model: type[_Common], body: bytes | str) -> _Common:
    """The request from its raw JSON body, or BadRequest naming the first field that does not fit
    (malformed JSON, lone UTF-16 surrogates and over-deep nesting included)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise BadRequest(_json_error(err["msg"].removeprefix("Invalid JSON: "))) from None
        if err["type"] == "model_type" and not err["loc"]:
            raise BadRequest("the request body must be a JSON object") from None
        # a union's errors name its member types in the location ("prompt", "list[int]", 0): drop them
        path = [str(x) for x in err["loc"] if not (isinstance(x, str) and (x in _TYPE_NAMES or "[" in x))]
        param = ".".join(path) or None
        if path and path[0] == "prompt":
            raise BadRequest(
                "prompt must be a string or a list of token ids (non-negative integers)", "prompt"
            ) from None
        raise BadRequest(_field_error(param, err), param) from None


# what a bounded field allows, where it says more than its schema bound
_ALLOWED = {"top_k": TOP_K_ALLOWED}


def _field_error(param: str | None, err: dict) -> str:
    """A field's problem as the validator words its own: what is wrong and what is allowed."""
    msg = err["msg"].removeprefix("Value error, ")
    if param and err["type"] in ("greater_than_equal", "less_than_equal"):
        ge, le = err["ctx"].get("ge"), err["ctx"].get("le")
        allowed = _ALLOWED.get(param, f">= {ge}") if ge is not None else f"<= {le}"
        return f"{param} must be {allowed}, got {err['input']}"
    if not param or msg.startswith(param):
        return msg
    return f"{param}: {msg}"


def _json_error(msg: str) -> str:
    """The parser's message, or for a lone UTF-16 surrogate escape (which the parser calls a bad
    hex escape) what is wrong with it."""
    where = msg[msg.rfind(" at line ") :] if " at line " in msg else ""
    if "surrogate" in msg or "end of hex escape" in msg:
        return (
            f"the request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair){where}; "
            f"strings must be valid Unicode (surrogates only in high-low pairs, such as \\ud83d\\ude00)"
        )
    return f"the request body is not valid JSON: {msg}"
