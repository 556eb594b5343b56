import itertools
import math
import struct
import warnings
import zlib

import msgpack
import pytest
import torch

from pdserve.engine.kv.codec import (
    KvCodecError,
    KvDecoder,
    KvLimits,
    KvPayload,
    ModelFingerprint,
    crc32,
    encode_kv,
    pack_kv,
    unpack_kv,
)
from pdserve.engine.kv.frame_header import FORMAT_VERSION
from pdserve.engine.kv.framing import FrameAssembler, iter_chunks

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_fp(**overrides) -> ModelFingerprint:
    fields = dict(
        architecture="LlamaForCausalLM",
        num_layers=2,
        num_kv_heads=3,
        head_dim=8,
        dtype="float32",
        block_size=16,
        tokenizer_hash="ab" * 32,
    )
    fields.update(overrides)
    return ModelFingerprint(**fields)


def make_payload(fp: ModelFingerprint, num_tokens: int = 5, seed: int = 0) -> KvPayload:
    g = torch.Generator().manual_seed(seed)
    shape = (fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim)
    kv = torch.randn(shape, generator=g).to(DTYPES[fp.dtype])
    token_ids = torch.randint(0, 50_000, (num_tokens,), generator=g).tolist()
    sampling = {"temperature": 0.7, "top_p": 0.9, "seed": 1234, "stop": [2, 13], "max_tokens": None}
    return KvPayload(f"req-{seed}", fp, token_ids, 42, sampling, kv)


def split(frame: bytes) -> tuple[dict, bytes]:
    hlen = struct.unpack_from("<I", frame, 4)[0]
    return msgpack.unpackb(frame[8 : 8 + hlen], raw=False), frame[8 + hlen :]


def join(header, body: bytes = b"", magic: bytes = b"PDKV") -> bytes:
    hdr = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return magic + struct.pack("<I", len(hdr)) + hdr + body


def forged(mutate) -> bytes:
    header, body = split(pack_kv(make_payload(make_fp())))
    mutate(header)
    return join(header, body)


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_tokens,dims", [(1, (2, 3, 8)), (300, (4, 2, 64)), (17, (1, 1, 2))])
def test_round_trip_exact(dtype, num_tokens, dims):
    fp = make_fp(dtype=dtype, num_layers=dims[0], num_kv_heads=dims[1], head_dim=dims[2])
    src = make_payload(fp, num_tokens, seed=num_tokens)
    src.first_token_unix_ns = 1_764_400_000_123_456_789 + num_tokens
    frame = pack_kv(src)
    assert frame[:4] == b"PDKV"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's non-writable buffer warning
        out = unpack_kv(frame, fp)

    assert out.kv.dtype == DTYPES[dtype]
    assert out.kv.shape == (dims[0], 2, num_tokens, dims[1], dims[2])
    assert torch.equal(out.kv, src.kv)
    assert out.request_id == src.request_id
    assert out.fingerprint == fp
    assert out.token_ids == src.token_ids
    assert out.first_token == 42
    assert out.first_token_unix_ns == src.first_token_unix_ns
    assert out.sampling == src.sampling

    header, body = split(frame)
    assert header["version"] == FORMAT_VERSION
    assert header["nbytes"] == len(body) == src.kv.numel() * src.kv.element_size()
    assert header["checksum"] == zlib.crc32(body)


def test_round_trip_from_bytearray_and_memoryview_owns_memory():
    fp = make_fp(dtype="bfloat16")
    src = make_payload(fp, 9)
    buf = bytearray(pack_kv(src))
    out = unpack_kv(memoryview(buf), fp)
    assert torch.equal(out.kv, src.kv)
    buf[-64:] = bytes(64)  # mutating the input must not change the decoded tensor
    assert torch.equal(out.kv, src.kv)
    out.kv.zero_()  # writable
    assert torch.equal(unpack_kv(bytes(pack_kv(src)), fp).kv, src.kv)


def test_non_contiguous_input_is_packed_in_logical_order():
    fp = make_fp(num_kv_heads=4, head_dim=4)
    base = torch.randn(2, 2, 6, 4, 4)
    kv = base.transpose(3, 4)
    assert not kv.is_contiguous()
    src = KvPayload("r", fp, list(range(6)), 0, {}, kv)
    assert torch.equal(unpack_kv(pack_kv(src), fp).kv, kv)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_dict_round_trip_and_mismatches():
    fp = make_fp()
    assert ModelFingerprint.from_dict(fp.to_dict()) == fp
    assert fp.mismatches(make_fp()) == []
    assert fp.mismatches(make_fp(num_layers=5, tokenizer_hash="cd")) == [
        "num_layers 2 != 5",
        f"tokenizer_hash {'ab' * 32!r} != 'cd'",
    ]


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda d: d.pop("head_dim"), "fingerprint missing key 'head_dim'"),
        (lambda d: d.update(num_layers="2"), "num_layers must be a positive int"),
        (lambda d: d.update(num_layers=True), "num_layers must be a positive int"),
        (lambda d: d.update(block_size=0), "block_size must be a positive int"),
        (lambda d: d.update(architecture=7), "architecture must be a str"),
        (lambda d: d.update(extra=1), "unknown keys: extra"),
    ],
)
def test_fingerprint_from_dict_rejects(mutate, msg):
    d = make_fp().to_dict()
    mutate(d)
    with pytest.raises(KvCodecError, match=msg):
        ModelFingerprint.from_dict(d)


# ---------------------------------------------------------------- refusals


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
        (lambda h: h.update(version=1), r"unsupported format version 1 \(expected 2\)"),
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


# ---------------------------------------------------------------- chunking


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


# ---------------------------------------------------------------- parts, streaming decode


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
