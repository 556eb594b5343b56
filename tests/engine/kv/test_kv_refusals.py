"""unpack_kv and pack_kv refuse what does not fit: another model, damaged or forged frames, sizes past the limits."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError, KvLimits, KvPayload, pack_kv, unpack_kv
from tests.engine.kv._kv_payloads import forged, join, make_fp, make_payload, split


def test_wrong_fingerprint_names_every_field():
    frame = pack_kv(make_payload(make_fp()))
    with pytest.raises(KvCodecError, match=r"^model fingerprint mismatch: num_layers 2 != 5$"):
        unpack_kv(frame, make_fp(num_layers=5))
    with pytest.raises(KvCodecError) as ei:
        unpack_kv(frame, make_fp(block_size=32, tokenizer_hash="00"))
    assert "block_size 16 != 32" in str(ei.value) and "tokenizer_hash" in str(ei.value)
    assert "num_layers" not in str(ei.value)


def test_flipped_tensor_byte_fails_checksum():
    frame = bytearray(pack_kv(make_payload(make_fp())))
    frame[-7] ^= 0x10
    with pytest.raises(KvCodecError, match="checksum mismatch"):
        unpack_kv(frame, make_fp())


def test_truncated_and_trailing():
    fp = make_fp()
    frame = pack_kv(make_payload(fp))
    _, body = split(frame)
    n = len(body)
    with pytest.raises(KvCodecError, match=f"truncated frame: expected {n} bytes of tensor data, got {n - 10}"):
        unpack_kv(frame[:-10], fp)
    with pytest.raises(KvCodecError, match="truncated frame: expected .* header bytes"):
        unpack_kv(frame[:20], fp)
    with pytest.raises(KvCodecError, match="truncated frame: expected 8 prefix bytes, got 3"):
        unpack_kv(frame[:3], fp)
    with pytest.raises(KvCodecError, match=f"trailing bytes: expected {n} bytes of tensor data, got {n + 1}"):
        unpack_kv(frame + b"\0", fp)


def test_bad_magic():
    frame = pack_kv(make_payload(make_fp()))
    with pytest.raises(KvCodecError, match="bad magic"):
        unpack_kv(b"PDKW" + frame[4:], make_fp())


def test_header_length_over_limit():
    frame = pack_kv(make_payload(make_fp()))
    hlen = struct.unpack_from("<I", frame, 4)[0]
    with pytest.raises(KvCodecError, match=f"header too large: {hlen} > limit 16"):
        unpack_kv(frame, make_fp(), KvLimits(max_header_bytes=16))
    huge = b"PDKV" + struct.pack("<I", 0xFFFFFFFF) + b"\x80"
    with pytest.raises(KvCodecError, match=f"header too large: {0xFFFFFFFF} > limit {1 << 20}"):
        unpack_kv(huge, make_fp())


def test_oversize_claimed_nbytes_refused_before_allocating(monkeypatch):
    big = make_fp(num_layers=1000, num_kv_heads=1000, head_dim=1000)
    header, _ = split(pack_kv(make_payload(make_fp(), num_tokens=300)))
    shape = [1000, 2, 300, 1000, 1000]
    header.update(fingerprint=big.to_dict(), shape=shape, nbytes=math.prod(shape) * 4)

    def no_alloc(*a, **k):
        raise AssertionError("tensor allocated")

    monkeypatch.setattr(torch, "frombuffer", no_alloc)
    monkeypatch.setattr(torch, "empty", no_alloc)
    # No tensor bytes follow: a size check after reading would report truncation instead.
    with pytest.raises(KvCodecError, match=r"tensor too large: 2400000000000 bytes > limit 4294967296"):
        unpack_kv(join(header), big)
    header["nbytes"] = 1 << 40
    with pytest.raises(KvCodecError, match=r"nbytes 1099511627776 != 2400000000000 implied by shape"):
        unpack_kv(join(header), big)


def test_tensor_and_token_limits():
    fp = make_fp()
    frame = pack_kv(make_payload(fp, num_tokens=300))
    with pytest.raises(KvCodecError, match="tensor too large: 115200 bytes > limit 1000"):
        unpack_kv(frame, fp, KvLimits(max_tensor_bytes=1000))
    with pytest.raises(KvCodecError, match="too many tokens: 300 > limit 100"):
        unpack_kv(frame, fp, KvLimits(max_tokens=100))


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda h: h.update(token_ids=h["token_ids"][:-1]), r"shape \[2, 2, 5, 3, 8\] does not .* \[2, 2, 4, 3, 8\]"),
        (lambda h: h.update(shape=[2, 2, 5, 24]), "shape must be 5 ints"),
        (lambda h: h.update(shape=[2, 1, 10, 3, 8]), r"does not match fingerprint/token count \[2, 2, 5, 3, 8\]"),
        (lambda h: h.update(dtype="float16"), "dtype float16 does not match fingerprint dtype float32"),
        (lambda h: h.update(dtype="int8"), "unsupported dtype 'int8'"),
        (lambda h: h.update(version=2), r"unsupported format version 2 \(expected 3\): the prefill and decode"),
        (lambda h: h.pop("version"), "unsupported format version None"),
        (lambda h: h.pop("checksum"), "header missing key 'checksum'"),
        (lambda h: h.update(first_token="x"), "header key 'first_token' must be int, got str"),
        (lambda h: h.update(sampling=[1]), "header key 'sampling' must be dict, got list"),
        (lambda h: h.update(token_ids=[1, 2, 3, 4, 5.0]), "token_ids must all be ints"),
        (lambda h: h["fingerprint"].pop("dtype"), "fingerprint missing key 'dtype'"),
    ],
)
def test_forged_header_refused(mutate, msg):
    with pytest.raises(KvCodecError, match=msg):
        unpack_kv(forged(mutate), make_fp())


@pytest.mark.parametrize(
    "header,msg",
    [
        (msgpack.packb([1, 2, 3]), r"header is not a map \(got list\)"),
        (b"\xc1", "malformed header"),  # reserved msgpack byte
        (msgpack.packb({"a": 1}) + b"\x00", "malformed header"),  # extra data
        (msgpack.packb({1: 2}), "malformed header"),  # non-str map key
        (msgpack.packb({"s": "x" * 100})[:-50], "malformed header"),  # cut string
    ],
)
def test_bad_header_encoding(header, msg):
    with pytest.raises(KvCodecError, match=msg):
        unpack_kv(join(header), make_fp())


def test_pack_rejects_inconsistent_payload():
    fp = make_fp()
    p = make_payload(fp)
    with pytest.raises(KvCodecError, match="kv dtype torch.float16 does not match fingerprint dtype 'float32'"):
        pack_kv(KvPayload(p.request_id, fp, p.token_ids, 1, {}, p.kv.half()))
    with pytest.raises(KvCodecError, match="does not match fingerprint/token count"):
        pack_kv(KvPayload(p.request_id, fp, p.token_ids[:-1], 1, {}, p.kv))
    with pytest.raises(KvCodecError, match="no tokens"):
        pack_kv(KvPayload("r", fp, [], 1, {}, torch.zeros(2, 2, 0, 3, 8)))
    with pytest.raises(KvCodecError, match="header not encodable"):
        pack_kv(KvPayload(p.request_id, fp, p.token_ids, 1, {"x": object()}, p.kv))
