"""Incremental detokenization for streaming, without torch or transformers.

Text is produced by decoding a bounded window of recent tokens.  When the window
does not start at the first token it is decoded behind an *anchor* token (a plain
ASCII letter) whose text is then cut off; this keeps decoders that treat the first
token specially (Metaspace, a leading ``Strip``) from dropping a space that the
one-shot decode keeps.  The window start only moves to a boundary where decoding
the two halves separately reproduces the window text, the left half ends in a
complete character, and no byte-fallback run is split, so the streamed text always
equals ``Tokenizer.decode`` of all ids.  Decoders with cross-token effects that are
not understood fall back to decoding every id on each call.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Sequence

from pdserve.engine.text.tokenizer import Tokenizer, TokenizerError, _checked

__all__ = ["IncrementalDetokenizer"]

_DROP, _BYTE, _PLAIN = 0, 1, 2
_REPL = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_MAX_WINDOW, _KEEP, _TRIES = 24, 6, 4
_INFO: weakref.WeakKeyDictionary[Tokenizer, _StreamInfo] = weakref.WeakKeyDictionary()


def _flatten(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for sub in spec.get("decoders", []) for d in _flatten(sub)]
    return [spec]


def _windowable(spec: dict | None) -> bool:
    """True when the decoder only has cross-token effects this module handles."""
    fused = False
    for step in _flatten(spec):
        kind = step.get("type")
        if kind in ("Fuse", "ByteLevel"):
            fused = True
        elif kind == "Replace":
            pattern = step.get("pattern", {})
            if fused and len(pattern.get("String", "")) != 1:
                return False
        elif kind == "Strip":
            if fused and step.get("stop", 0):
                return False
        elif kind not in ("ByteFallback", "Metaspace"):
            return False
    return True


class _StreamInfo:
    """Per-tokenizer facts shared by all detokenizers of that tokenizer."""

    def __init__(self, tok: Tokenizer) -> None:
        self.backend = tok.backend
        steps = _flatten(tok.decoder_config)
        self.byte_fallback = any(s.get("type") == "ByteFallback" for s in steps)
        self.specials = {tok.backend.id_to_token(i) for i in tok.special_token_ids}
        self.kinds: dict[int, int] = {}
        self.anchor: int | None = None
        if _windowable(tok.decoder_config):
            for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ":
                i = tok.backend.token_to_id(ch)
                if i is not None and self.kind(i) == _PLAIN and self.decode([i, i]) == ch + ch:
                    self.anchor, self.anchor_text = i, ch
                    break

    def kind(self, i: int) -> int:
        k = self.kinds.get(i)
        if k is None:
            piece = self.backend.id_to_token(i)
            if piece is None or piece in self.specials:
                k = _DROP
            elif self.byte_fallback and _BYTE_TOKEN.fullmatch(piece):
                k = _BYTE
            else:
                k = _PLAIN
            self.kinds[i] = k
        return k

    def decode(self, ids: list[int], anchored: bool = False) -> str:
        if anchored:
            return self.backend.decode([self.anchor, *ids], skip_special_tokens=True)[len(self.anchor_text) :]
        return self.backend.decode(ids, skip_special_tokens=True)


def _info(tok: Tokenizer) -> _StreamInfo:
    return _INFO.get(tok) or _INFO.setdefault(tok, _StreamInfo(tok))


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas for streaming.

    ``text`` holds all text emitted so far; ``stopped`` becomes True once a stop
    string appeared: the text before the first completed stop string is emitted,
    nothing from the stop string on.  Without stop strings,
    ``"".join(add(...) results) + finish()`` equals ``tokenizer.decode(all ids)``
    exactly, however the ids are split over ``add`` calls.  Empty stop strings are
    ignored; a non-string stop raises :class:`TokenizerError`.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        if isinstance(stop, str) or any(not isinstance(s, str) for s in stop):
            raise TokenizerError("stop must be a sequence of strings")
        self._info = _info(tokenizer)
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._win: list[int] = []  # kept ids (special/unknown ones dropped) from the window start
        self._anchored = False  # True once the window no longer starts at the first token
        self._done = 0  # characters of the window text already released
        self._held = ""  # released text withheld because it may begin a stop string
        self._finished = False
        self.stopped = False
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the newly safe-to-emit text (possibly "").

        Text is held back while it ends in an incomplete character, inside an open
        byte-fallback run, or in a possible start of a stop string.  Returns "" once
        stopped.  Raises :class:`TokenizerError` for negative or non-integer ids and
        ``RuntimeError`` when called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("add() called after finish()")
        ids = _checked(token_ids)
        if self.stopped:
            return ""
        info, start = self._info, len(self._win)
        self._win.extend(i for i in ids if info.kind(i) != _DROP)
        if len(self._win) == start:
            return ""
        full = self._decode(self._win)
        cut = len(self._win)
        if info.byte_fallback:  # a byte run may still turn invalid: hold it whole
            while cut and info.kind(self._win[cut - 1]) == _BYTE:
                cut -= 1
        if info.anchor is None:  # unknown decoder: the last token's text may still change
            cut = min(cut, len(self._win) - 1)
        safe = full if cut == len(self._win) else os.path.commonprefix([full, self._decode(self._win[:cut])])
        end = len(safe.rstrip(_REPL))
        delta = full[self._done : end] if end > self._done else ""
        self._done += len(delta)
        if info.anchor is not None and len(self._win) > _MAX_WINDOW:
            self._slide(full)
        return self._release(delta, final=False)

    def finish(self) -> str:
        """Flush and return all text still held back (call once, at the end).

        A trailing incomplete character becomes U+FFFD, as in a one-shot decode.
        Returns "" when already stopped or finished; a stop string completed by the
        flushed text is honoured.
        """
        if self._finished or self.stopped:
            self._finished = True
            return ""
        self._finished = True
        delta = self._decode(self._win)[self._done :] if self._win else ""
        return self._release(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._info.decode(ids, self._anchored)

    def _slide(self, full: str) -> None:
        """Move the window start forward to a boundary that is safe for any continuation."""
        info, win = self._info, self._win
        for q in range(len(win) - _KEEP, max(len(win) - _KEEP - _TRIES, 0), -1):
            if info.byte_fallback and info.kind(win[q - 1]) == _BYTE and info.kind(win[q]) == _BYTE:
                continue
            head = self._decode(win[:q])
            if not head or head[-1] == _REPL or len(head) > self._done:
                continue
            if head + info.decode(win[q:], anchored=True) != full:
                continue
            self._win, self._anchored, self._done = win[q:], True, self._done - len(head)
            return

    def _release(self, delta: str, final: bool) -> str:
        """Apply stop strings to newly stable text; return what may be emitted now."""
        buf = self._held + delta
        if not self._stops:
            self.text += buf
            return buf
        # the stop string that is completed first wins (then the one starting first)
        hits = [(i + len(s), i) for s in self._stops for i in (buf.find(s),) if i >= 0]
        if hits:
            out, self._held, self.stopped = buf[: min(hits)[1]], "", True
        else:
            keep = (
                0
                if final
                else max(
                    (n for s in self._stops for n in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:n])),
                    default=0,
                )
            )
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out
