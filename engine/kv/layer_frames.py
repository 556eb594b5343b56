"""Layer-wise KV streams: the frames a prefill worker sends while its forward pass is still running.

A stream is a sequence of frames of :mod:`pdserve.engine.kv.codec`'s framing (``b"PDKV" | uint32 LE
header length | msgpack header | tensor bytes``), every header with ``version`` and ``kind``:

1. one ``"head"`` frame: the request (``request_id, fingerprint, dtype, shape, token_ids, sampling,
   kv_start, prefix_hashes``; ``shape`` the whole KV's, ``[num_layers, 2, num_tokens - kv_start,
   num_kv_heads, head_dim]``), ``nbytes`` 0 and ``checksum`` 0: no tensor bytes yet. The receiver
   checks it as a whole frame's header (fingerprint, limits) and reserves the KV blocks.
2. rounds of ``"layer"`` frames, one round per prefill step: the K and V of positions
   ``start .. start + tokens - 1`` of layers 0, 1, .. num_layers - 1 in order, each with ``layer,
   start, tokens``, its ``nbytes`` (``2 * tokens * num_kv_heads * head_dim * itemsize``), the CRC-32
   ``checksum`` of its tensor bytes, then those bytes: ``[2, tokens, num_kv_heads, head_dim]`` C-contiguous.
   The first round starts at ``kv_start``, each next one where the last ended; the last one ends
   at ``len(token_ids)``. A layer with a sliding window (``ModelFingerprint.layers``) sends only
   the positions the first decode query's window reads (``frame_start``): its frame of a round
   may start later than the round, or hold no position at all (``tokens`` 0, ``start`` the
   round's end, no tensor bytes).
3. one ``"end"`` frame: ``first_token`` and ``first_token_unix_ns`` (known only once the last layer
   ran and the prefill worker sampled), ``nbytes`` 0, ``checksum`` 0.

``layer`` and ``end`` frames carry the fingerprint's sha256 digest (``ModelFingerprint.digest``)
and the request id; the head carries the fingerprint itself.
:class:`~pdserve.engine.kv.stream_decoder.KvStreamDecoder` reads what
one ``PushKv`` call carries, a whole frame or such a stream, and refuses anything else with a
KvCodecError: a frame out of order, duplicated or missing, a bad checksum, a size past
:class:`~pdserve.engine.kv.frame_header.KvLimits` (checked before any allocation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import torch

from pdserve.engine.kv.codec import KvPayload, crc32
from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint, layout_windows
from pdserve.engine.kv.frame_header import (
    FORMAT_VERSION,
    KIND_END,
    KIND_HEAD,
    KIND_LAYER,
    MAGIC,
    PREFIX_STRUCT,
    KvLimits,
    check_request_header,
)
from pdserve.engine.scheduling.kv_groups import window_block_start


def frame_start(window: int | None, block_size: int, num_tokens: int, start: int, end: int) -> int:
    """First position a layer's frame of the round ``start .. end - 1`` holds: ``start`` for a
    full-attention layer; for one with a sliding window, not before the block of the first
    position the first decode query (at ``num_tokens``, the prompt's length) reads,
    ``num_tokens - window + 1`` (``kv_groups.window_block_start``), and at most ``end``."""
    if window is None:
        return start
    return min(end, max(start, window_block_start(window, block_size, num_tokens)))


def _frame(header: dict) -> bytes:
    hdr = msgpack.packb({"version": FORMAT_VERSION, **header}, use_bin_type=True)
    return PREFIX_STRUCT.pack(MAGIC, len(hdr)) + hdr


@dataclass
class KvStreamHead:
    """What a head frame says: a :class:`~pdserve.engine.kv.codec.KvPayload` but its KV and first token."""

    request_id: str
    fingerprint: ModelFingerprint
    token_ids: list[int]
    sampling: dict
    kv_start: int = 0
    prefix_hashes: list[bytes] = field(default_factory=list)

    def payload(self, kv: torch.Tensor, first_token: int, first_token_unix_ns: int = 0) -> KvPayload:
        return KvPayload(
            self.request_id,
            self.fingerprint,
            self.token_ids,
            first_token,
            self.sampling,
            kv,
            first_token_unix_ns,
            self.kv_start,
            self.prefix_hashes,
        )


def encode_head(head: KvStreamHead) -> bytes:
    """The head frame of ``head``'s stream (KvCodecError for fields a receiver would refuse)."""
    fp, n = head.fingerprint, len(head.token_ids)
    shape = [fp.num_layers, 2, n - head.kv_start, fp.num_kv_heads, fp.head_dim]
    header = {
        "kind": KIND_HEAD,
        "request_id": head.request_id,
        "fingerprint": fp.to_dict(),
        "dtype": fp.dtype,
        "shape": shape,
        "token_ids": [int(t) for t in head.token_ids],
        "sampling": head.sampling,
        "nbytes": 0,
        "checksum": 0,
        "kv_start": int(head.kv_start),
        "prefix_hashes": [bytes(h) for h in head.prefix_hashes],
    }
    check_request_header(dict(header, version=FORMAT_VERSION), fp, KvLimits(1 << 62, 1 << 62, 1 << 62), KIND_HEAD)
    try:
        return _frame(header)
    except (TypeError, ValueError, OverflowError) as e:
        raise KvCodecError(f"header not encodable: {e}") from e


def encode_layer(request_id: str, digest: str, layer: int, start: int, kv: torch.Tensor) -> tuple[bytes, memoryview]:
    """A layer frame as two parts (header, tensor bytes): ``kv`` [2, tokens, num_kv_heads, head_dim]
    on CPU holds positions ``start ..`` of ``layer``; its bytes are read in place when it is contiguous."""
    data = memoryview(kv.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).toreadonly()
    header = {"kind": KIND_LAYER, "request_id": request_id, "fingerprint": digest, "layer": layer}
    header |= {"start": start, "tokens": kv.shape[1], "nbytes": data.nbytes, "checksum": crc32(data)}
    return _frame(header), data


def encode_end(request_id: str, digest: str, first_token: int, first_token_unix_ns: int) -> bytes:
    """The end frame: the first token, sampled after the last layer."""
    header = {"kind": KIND_END, "request_id": request_id, "fingerprint": digest, "first_token": int(first_token)}
    return _frame(header | {"first_token_unix_ns": int(first_token_unix_ns), "nbytes": 0, "checksum": 0})


def stream_frames(payload: KvPayload, rounds: list[int] | None = None) -> list:
    """``payload`` as a layer-wise stream (a list of frames, each bytes or a (header, data) pair);
    ``rounds``: the tokens of each round (default: one round of all)."""
    p, fp, kv = payload, payload.fingerprint, payload.kv
    head = KvStreamHead(p.request_id, fp, p.token_ids, p.sampling, p.kv_start, p.prefix_hashes)
    frames, digest, at = [encode_head(head)], fp.digest(), 0
    windows = layout_windows(fp.layers) or [None] * fp.num_layers
    for tokens in rounds or [kv.shape[2]]:
        start, end = p.kv_start + at, p.kv_start + at + tokens
        for layer, window in enumerate(windows):
            first = frame_start(window, fp.block_size, len(p.token_ids), start, end)
            part = kv[layer, :, first - p.kv_start : end - p.kv_start]
            frames.append(encode_layer(p.request_id, digest, layer, first, part))
        at += tokens
    return [*frames, encode_end(payload.request_id, digest, payload.first_token, payload.first_token_unix_ns)]


@dataclass
class LayerKv:
    """Positions ``start .. start + kv.shape[1] - 1`` of ``layer``: ``kv`` [2, tokens, num_kv_heads, head_dim]."""

    layer: int
    start: int
    kv: torch.Tensor


@dataclass
class KvStreamEnd:
    first_token: int
    first_token_unix_ns: int
