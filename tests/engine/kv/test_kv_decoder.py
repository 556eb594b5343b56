"""encode_kv's parts and the streaming KvDecoder: a frame split anywhere decodes, and checks run as bytes arrive."""

from __future__ import annotations

import zlib

import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError, KvDecoder, KvLimits, crc32, encode_kv, pack_kv, unpack_kv
from pdserve.engine.kv.framing import iter_chunks
from tests.engine.kv._kv_payloads import make_fp, make_payload


def test_encode_kv_parts_join_to_pack_kv_and_view_the_tensor():
    fp = make_fp(dtype="bfloat16")
    src = make_payload(fp, 11)
    head, body = encode_kv(src)
    assert head + bytes(body) == pack_kv(src)
    assert body.readonly and body.nbytes == src.kv.numel() * 2
    src.kv.add_(1)  # the body is the tensor's memory, not a copy
    assert bytes(body) == bytes(memoryview(src.kv.view(torch.uint8).numpy()).cast("B"))


def cut(frame: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for n in sizes:
        out.append(frame[at : at + n])
        at += n
    return out + [frame[at:]]


@pytest.mark.parametrize("sizes", [[1] * 30, [3, 5, 100], [9], [8], [4, 4, 0, 1]])
def test_unpack_kv_from_parts_split_anywhere(sizes):
    fp = make_fp()
    src = make_payload(fp, 13)
    frame = pack_kv(src)
    for parts in (cut(frame, sizes), list(iter_chunks(encode_kv(src), 37)), list(encode_kv(src))):
        out = unpack_kv(parts, fp)
        assert torch.equal(out.kv, src.kv) and out.token_ids == src.token_ids


def test_decoder_refuses_a_bad_header_before_tensor_bytes_arrive(monkeypatch):
    fp = make_fp()
    head, body = encode_kv(make_payload(fp, 40))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(AssertionError("allocated")))
    dec = KvDecoder(make_fp(head_dim=16))
    dec.add(head[:-1])  # header still incomplete: nothing checked, nothing allocated
    with pytest.raises(KvCodecError, match="model fingerprint mismatch: head_dim 8 != 16"):
        dec.add(head[-1:])
    with pytest.raises(KvCodecError, match="tensor too large"):
        KvDecoder(fp, KvLimits(max_tensor_bytes=100)).add(head)


def test_decoder_checks_as_bytes_arrive():
    fp = make_fp()
    head, body = encode_kv(make_payload(fp, 4))
    dec = KvDecoder(fp)
    for piece in [head, body[:10], body[10:]]:
        dec.add(piece)
    assert dec.received == len(head) + len(body)
    trailing = f"trailing bytes: expected {len(body)} bytes of tensor data, got {len(body) + 2}"
    with pytest.raises(KvCodecError, match=trailing):
        dec.add(b"xx")
    with pytest.raises(KvCodecError, match="bad magic"):
        KvDecoder(fp).add(b"GET / HTTP/1.1\r\n")
    dec = KvDecoder(fp)
    dec.add(head + body[:-1])
    with pytest.raises(KvCodecError, match=f"expected {len(body)} bytes of tensor data, got {len(body) - 1}"):
        dec.finish()
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 1
    dec = KvDecoder(fp)
    dec.add(head)
    dec.add(flipped)
    with pytest.raises(KvCodecError, match="checksum mismatch"):
        dec.finish()


def test_checksum_is_zlib_crc32_also_when_continued():
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    mv = memoryview(data.numpy())
    assert crc32(mv) == zlib.crc32(mv)
    assert crc32(mv[5:], crc32(mv[:5])) == zlib.crc32(mv)
