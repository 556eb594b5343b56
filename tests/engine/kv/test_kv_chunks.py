"""iter_chunks cuts a frame (or its parts) into messages and FrameAssembler puts them back, within the limits."""

from __future__ import annotations

import itertools
import math
import struct

import pytest

from pdserve.engine.kv.codec import KvCodecError, KvLimits, encode_kv, pack_kv
from pdserve.engine.kv.framing import FrameAssembler, iter_chunks
from tests.engine.kv._kv_payloads import make_fp, make_payload


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000, 4119, 1 << 20])
def test_iter_chunks(chunk_bytes):
    frame = pack_kv(make_payload(make_fp(), num_tokens=40))
    chunks = list(iter_chunks(frame, chunk_bytes))
    assert all(isinstance(c, memoryview) and 0 < len(c) <= chunk_bytes for c in chunks)
    assert len(chunks) == math.ceil(len(frame) / chunk_bytes)
    assert b"".join(chunks) == frame
    asm = FrameAssembler()
    for c in chunks:
        asm.add(c)
    assert asm.frame() == frame


@pytest.mark.parametrize("bad", [0, -1])
def test_iter_chunks_rejects_non_positive(bad):
    with pytest.raises(ValueError):
        list(iter_chunks(b"abc", bad))


def test_iter_chunks_never_spans_parts():
    head, body = encode_kv(make_payload(make_fp(), 40))
    chunks = list(iter_chunks([head, body], 1000))
    assert len(chunks) == math.ceil(len(head) / 1000) + math.ceil(len(body) / 1000)
    assert len(head) in itertools.accumulate(len(c) for c in chunks)  # the header ends a chunk
    assert all(0 < len(c) <= 1000 for c in chunks)
    assert b"".join(chunks) == head + bytes(body)
    asm = FrameAssembler()
    for c in chunks:
        asm.add(c)
    assert asm.size == len(head) + len(body) and b"".join(asm.parts()) == asm.frame() == head + bytes(body)


def test_assembler_refuses_growth_past_limits():
    limits = KvLimits(max_header_bytes=64, max_tensor_bytes=100)  # cap = 8 + 64 + 100
    asm = FrameAssembler(limits)
    asm.add(b"PDKV" + struct.pack("<I", 64))
    asm.add(bytes(150))
    with pytest.raises(KvCodecError, match="frame too large: 173 bytes > limit 172"):
        asm.add(bytes(15))
    assert len(asm.frame()) == 158  # refused chunk was not stored
    asm.add(bytes(14))
    assert len(asm.frame()) == 172


def test_assembler_checks_prefix_as_soon_as_complete():
    asm = FrameAssembler(KvLimits(max_header_bytes=64))
    asm.add(b"PDK")
    with pytest.raises(KvCodecError, match="header too large: 65 > limit 64"):
        asm.add(b"V" + struct.pack("<I", 65) + b"rest")
    assert asm.frame() == b"PDK"
    with pytest.raises(KvCodecError, match="bad magic"):
        FrameAssembler().add(b"GET / HTTP/1.1\r\n")
