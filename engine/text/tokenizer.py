"""Torch-free tokenizer over a Hugging Face model folder.

Only the ``tokenizers`` library, ``json`` and the standard library are used, so
the router process can tokenize without importing torch or transformers.  The
loading rules mirror what ``transformers.AutoTokenizer`` does for a fast
(``tokenizer.json``) tokenizer, so ``encode``/``decode`` give the same ids and
text as the Hugging Face tokenizer of the same folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

__all__ = ["Tokenizer", "TokenizerError"]

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class TokenizerError(ValueError):
    """Raised when a tokenizer folder cannot be loaded or an input is invalid."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _content(token: Any) -> str | None:
    """The text of a special-token entry (plain string or AddedToken-style dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _added(token: Any) -> AddedToken:
    if isinstance(token, dict):
        opts = {k: bool(token[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in token}
        opts.setdefault("normalized", False)
        return AddedToken(token["content"], special=True, **opts)
    return AddedToken(token, special=True, normalized=False)


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


class Tokenizer:
    """Torch-free tokenizer over a Hugging Face model folder (tokenizer.json,
    tokenizer_config.json, generation_config.json, config.json).

    Build it with :meth:`from_folder`.  Attributes: ``eos_token_ids`` (frozenset),
    ``bos_token_id`` (int or None), ``vocab_size`` (incl. added tokens),
    ``content_hash`` (sha256 hex of tokenizer.json), ``model_max_length`` and
    its alias ``max_model_len``, ``special_token_ids`` (ids that ``decode`` drops),
    ``decoder_config`` (the tokenizer.json ``decoder`` section) and ``backend``
    (the underlying ``tokenizers.Tokenizer``; treat it as read-only).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        content_hash: str,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        model_max_length: int,
        decoder_config: dict | None,
    ) -> None:
        self.backend = backend
        self.content_hash = content_hash
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.model_max_length = self.max_model_len = model_max_length
        self.decoder_config = decoder_config
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        Returns a ready :class:`Tokenizer`.  Raises :class:`TokenizerError` when the
        folder or its ``tokenizer.json`` is missing or unparsable, when a JSON config
        file is malformed, or when no maximum model length can be found (config.json
        ``max_position_embeddings`` or an equivalent key, else tokenizer_config
        ``model_max_length``).
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist")
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json; a fast (tokenizers) tokenizer file is required")
        raw = tj.read_bytes()
        try:
            spec = json.loads(raw)
            backend = _Backend.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"cannot parse {tj}: {exc}") from exc
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        text_cfg = model_cfg.get("text_config") if isinstance(model_cfg.get("text_config"), dict) else {}

        # Special tokens named in tokenizer_config are registered as special added
        # tokens, as transformers does on load (no-op when already present).
        specials = [cfg[k] for k in _NAMED_SPECIALS if _content(cfg.get(k)) is not None]
        for key in ("additional_special_tokens", "extra_special_tokens"):
            extra = cfg.get(key)
            extra = list(extra.values()) if isinstance(extra, dict) else extra
            if isinstance(extra, list):
                specials += [t for t in extra if _content(t) is not None]
        decoder_map = cfg.get("added_tokens_decoder")
        if isinstance(decoder_map, dict):
            specials += [
                t
                for t in decoder_map.values()
                if _content(t) is not None
                and isinstance(t, dict)
                and t.get("special")
                and backend.token_to_id(t["content"]) is None
            ]
        if specials:
            backend.add_special_tokens([_added(t) for t in specials])

        bos = _content(cfg.get("bos_token"))
        eos = _content(cfg.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if eos is not None else None

        # BOS/EOS come only from the tokenizer.json post-processor: with a
        # tokenizer.json present, transformers (v5) ignores add_bos_token /
        # add_eos_token in tokenizer_config, so BOS is never added a second time.
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        backend.no_truncation()
        backend.no_padding()

        eos_ids = {eos_id} if eos_id is not None else set()
        for source in (model_cfg, text_cfg, gen_cfg):
            eos_ids |= _ids(source.get("eos_token_id"))
        if bos_id is None:
            for source in (model_cfg, text_cfg, gen_cfg):
                if _ids(source.get("bos_token_id")):
                    bos_id = min(_ids(source["bos_token_id"]))
                    break

        max_len = next(
            (
                src[k]
                for src in (model_cfg, text_cfg)
                for k in _MAX_LEN_KEYS
                if isinstance(src.get(k), int) and src[k] > 0
            ),
            None,
        )
        if max_len is None:
            tml = cfg.get("model_max_length")
            if isinstance(tml, int) and 0 < tml < 10**9:
                max_len = tml
            else:
                raise TokenizerError(f"{folder}: config.json has no max_position_embeddings (or equivalent)")
        return cls(
            backend,
            content_hash=hashlib.sha256(raw).hexdigest(),
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=bos_id,
            model_max_length=int(max_len),
            decoder_config=spec.get("decoder"),
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return the token ids of ``text``, identical to ``AutoTokenizer(folder)(text)["input_ids"]``.

        Special tokens (such as BOS) are added by the post-processor exactly as the
        Hugging Face tokenizer adds them, unless ``add_special_tokens`` is False.
        Raises :class:`TokenizerError` if ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry (added tokens included). No token stands
        for more input bytes than its entry has (byte-level and SentencePiece entries spell their
        bytes with at least as many), so ``len(text.encode()) / max_token_bytes`` tokens is a
        lower bound on ``len(encode(text))`` that costs no tokenization."""
        return (
            max(
                (len(t.encode("utf-8", "surrogatepass")) for t in self.backend.get_vocab(with_added_tokens=True)),
                default=1,
            )
            or 1
        )

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids`` with special tokens skipped and no space clean-up.

        Equal to ``AutoTokenizer.decode(ids, skip_special_tokens=True,
        clean_up_tokenization_spaces=False)``; ids beyond the vocabulary are ignored.
        Raises :class:`TokenizerError` for a negative or non-integer id.
        """
        return self.backend.decode(_checked(ids), skip_special_tokens=True)


def _checked(ids: Sequence[int]) -> list[int]:
    """``ids`` as a list of non-negative ints; TokenizerError otherwise."""
    try:
        out = [operator.index(i) for i in ids]
    except TypeError as exc:
        raise TokenizerError(f"token ids must be integers: {exc}") from exc
    if out and min(out) < 0:
        raise TokenizerError(f"token ids must be non-negative, got {min(out)}")
    return [i for i in out if i <= 0xFFFFFFFF]  # larger ids are outside any vocabulary
