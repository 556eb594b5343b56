"""pack_kv/unpack_kv give back what was packed, bit for bit, and ModelFingerprint's dict form does too."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError, KvPayload, ModelFingerprint, pack_kv, unpack_kv
from pdserve.engine.kv.frame_header import FORMAT_VERSION
from tests.engine.kv._kv_payloads import DTYPES, make_fp, make_payload, split


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
