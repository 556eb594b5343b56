"""Reading what one ``PushKv`` call carries: one whole KV frame, or a layer-wise stream (the format
is in :mod:`pdserve.engine.kv.layer_frames`), checked frame by frame as its bytes arrive."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.kv.codec import Buffer, KvDecoder, KvPayload, _as_bytes_view, checksum_into
from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint, layout_windows
from pdserve.engine.kv.frame_header import (
    DTYPES,
    KIND_END,
    KIND_HEAD,
    KIND_LAYER,
    KIND_WHOLE,
    PREFIX_BYTES,
    KvLimits,
    check_request_header,
    check_types,
    decode_header,
    read_prefix,
)
from pdserve.engine.kv.layer_frames import KvStreamEnd, KvStreamHead, LayerKv, frame_start

_LAYER_TYPES = {"request_id": str, "fingerprint": str, "layer": int, "start": int, "tokens": int}
_LAYER_TYPES |= {"nbytes": int, "checksum": int}
_END_TYPES = {"request_id": str, "fingerprint": str, "first_token": int, "first_token_unix_ns": int}
_END_TYPES |= {"nbytes": int, "checksum": int}


class KvStreamDecoder:
    """Reads what one PushKv call carries: :meth:`add` its bytes in pieces of any size; each returns
    the events its bytes completed (:class:`KvStreamHead`, :class:`LayerKv`, :class:`KvStreamEnd`),
    in order. A whole frame gives no event: :meth:`finish` returns its payload (see ``KvDecoder``).
    :meth:`finish` raises KvCodecError for a stream that stopped before its end frame.

    ``alloc(nbytes)`` gives each layer's buffer and a whole frame's (a uint8 CPU tensor; default ``torch.empty``); a
    LayerKv's tensor is a view of it. Every error is a KvCodecError; a decoder that raised must be
    dropped."""

    def __init__(
        self,
        expected: ModelFingerprint,
        limits: KvLimits = KvLimits(),
        alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self._expected, self._digest, self._limits = expected, expected.digest(), limits
        self._dtype = DTYPES[expected.dtype]
        self._windows = layout_windows(expected.layers) or [None] * expected.num_layers
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8))
        self.whole: KvDecoder | None = None
        self.head: KvStreamHead | None = None
        self._raw = bytearray()  # prefix + header of the frame being read
        self._hlen: int | None = None
        self._frame: dict | None = None  # header of the layer frame whose tensor bytes are arriving
        self._buf, self._dst, self._got, self._crc = None, memoryview(b""), 0, 0
        self._next_layer, self._covered, self._round = 0, 0, (0, 0)
        self.ended = False
        self.received = 0

    def add(self, chunk: Buffer) -> list:
        mv, events = _as_bytes_view(chunk), []
        self.received += len(mv)
        if self.whole is not None:
            self.whole.add(mv)
            return events
        while len(mv):
            if self._frame is not None:  # tensor bytes of a layer frame
                take = min(len(mv), self._frame["nbytes"] - self._got)
                self._crc = checksum_into(self._dst, self._got, mv[:take], self._crc)
                self._got += take
                mv = mv[take:]
                if self._got == self._frame["nbytes"]:
                    events.append(self._layer_done())
                continue
            if self.ended:
                raise KvCodecError(f"trailing bytes after the end frame ({len(mv)} bytes)")
            need = PREFIX_BYTES + (self._hlen or 0)
            take = need - len(self._raw)
            self._raw += mv[:take]
            mv = mv[take:]
            if len(self._raw) < need:
                break
            if self._hlen is None:
                self._hlen = read_prefix(self._raw, self._limits)
                continue
            raw, self._raw, self._hlen = self._raw, bytearray(), None
            event = self._header(raw, mv)
            if event is not None:
                events.append(event)
            if self.whole is not None:
                return events
        return events

    def _header(self, raw: bytearray, rest: memoryview):
        header = decode_header(memoryview(raw)[PREFIX_BYTES:])
        kind = header.get("kind")
        if self.head is None:
            if kind == KIND_WHOLE:  # one whole frame: the codec's own decoder reads it
                self.whole = KvDecoder(self._expected, self._limits, self._alloc)
                self.whole.add(raw)
                self.whole.add(rest)
                return None
            if kind != KIND_HEAD:
                raise KvCodecError(f"a KV stream starts with a 'head' or 'kv' frame, not {kind!r}")
            h = check_request_header(header, self._expected, self._limits, KIND_HEAD)
            self.head = KvStreamHead(
                h["request_id"], h["fingerprint"], h["token_ids"], h["sampling"], h["kv_start"], h["prefix_hashes"]
            )
            self._covered = self.head.kv_start
            return self.head
        if kind not in (KIND_LAYER, KIND_END):
            raise KvCodecError(f"expected a 'layer' or 'end' frame after the head, got {kind!r}")
        check_types(header, _LAYER_TYPES if kind == KIND_LAYER else _END_TYPES)
        if header["request_id"] != self.head.request_id:
            raise KvCodecError(f"frame of request {header['request_id']!r} in the stream of {self.head.request_id!r}")
        if header["fingerprint"] != self._digest:
            raise KvCodecError(f"model fingerprint mismatch: digest {header['fingerprint']!r} != {self._digest!r}")
        if kind == KIND_END:
            return self._end(header)
        self._start_layer(header)
        if header["nbytes"] == 0:  # a sliding-window layer with nothing to send this round
            self._layer_done()
        return None

    def _start_layer(self, h: dict) -> None:
        fp, n = self._expected, len(self.head.token_ids)
        layer, start, tokens = h["layer"], h["start"], h["tokens"]
        if layer != self._next_layer:
            raise KvCodecError(f"layer frames out of order: got layer {layer}, expected layer {self._next_layer}")
        if tokens < 0:
            raise KvCodecError(f"layer {layer} frame of {tokens} positions")
        if layer == 0:  # every frame of a round ends where the round ends
            end = start + tokens
            if not self._covered < end <= n:
                raise KvCodecError(
                    f"layer 0 frame of positions {start}..{end - 1}: expected positions from "
                    f"{self._covered} to at most {n - 1}"
                )
            self._round = (self._covered, end)
        first = frame_start(self._windows[layer], fp.block_size, n, *self._round)
        if (start, start + tokens) != (first, self._round[1]):
            raise KvCodecError(
                f"layer {layer} frame of positions {start}..{start + tokens - 1}: expected positions from "
                f"{first} to {self._round[1] - 1}"
            )
        want = 2 * tokens * fp.num_kv_heads * fp.head_dim * self._dtype.itemsize
        if h["nbytes"] != want:
            raise KvCodecError(f"layer frame nbytes {h['nbytes']} != {want} implied by its {tokens} positions")
        self._frame, self._got, self._crc = h, 0, 0
        self._buf = self._alloc(want) if want else torch.empty(0, dtype=torch.uint8)
        self._dst = memoryview(self._buf.numpy())

    def _layer_done(self) -> LayerKv:
        h, fp = self._frame, self._expected
        if self._crc != h["checksum"]:
            raise KvCodecError(
                f"checksum mismatch in layer {h['layer']}: header {h['checksum']:#010x}, data {self._crc:#010x}"
            )
        kv = self._buf.view(self._dtype).view(2, h["tokens"], fp.num_kv_heads, fp.head_dim)
        self._frame, self._buf, self._dst = None, None, memoryview(b"")
        self._next_layer += 1
        if self._next_layer == fp.num_layers:
            self._next_layer, self._covered = 0, self._round[1]
        return LayerKv(h["layer"], h["start"], kv)

    def _end(self, h: dict) -> KvStreamEnd:
        if h["nbytes"] != 0 or h["checksum"] != 0:
            raise KvCodecError("an end frame carries no tensor bytes: its nbytes and checksum must be 0")
        n = len(self.head.token_ids)
        if self._next_layer or self._covered != n:
            raise KvCodecError(
                f"stream ended with missing layers: all layers cover positions up to {self._covered} of {n}, "
                f"and {self._next_layer} layers of the next round arrived"
            )
        self.ended = True
        return KvStreamEnd(h["first_token"], h["first_token_unix_ns"])

    def finish(self) -> KvPayload | None:
        """The payload of a whole frame, None after a complete stream; KvCodecError for a stream
        that stopped early (before its head, in a frame, or before its end frame)."""
        if self.whole is not None:
            return self.whole.finish()
        if not self.ended:
            where = (
                "before its head frame"
                if self.head is None
                else f"at position {self._covered}, layer {self._next_layer}"
            )
            raise KvCodecError(f"truncated stream: it stopped {where}, without its end frame")
        return None
