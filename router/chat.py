"""Chat templates: the model folder's Jinja template, rendered as transformers'
``apply_chat_template`` renders it (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, the
``raise_exception`` and ``strftime_now`` globals, a ``tojson`` that does not escape HTML).

The template comes from ``chat_template.jinja`` or the ``chat_template`` key of
``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not render with it (a bad request)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _special(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def read_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """(template source or None, special tokens by name such as ``bos_token``) of a model folder."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    specials = {
        k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (s := _special(cfg.get(k))) is not None
    }
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8"), specials
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), specials


class ChatTemplate:
    """A compiled chat template; ``render`` turns OpenAI-style messages into the prompt text.

    A model without a template still gets an instance: its ``render`` raises ChatTemplateError,
    so only the clients that ask for chat see the error.
    """

    def __init__(self, source: str | None, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(source)

    @classmethod
    def from_folder(cls, model_dir: Path) -> ChatTemplate:
        return cls(*read_template(model_dir))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``).

        Raises ChatTemplateError when the model has no template or the template refuses the
        messages (its ``raise_exception``, or a Jinja error).
        """
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); use /v1/completions with a prompt instead"
            )
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
