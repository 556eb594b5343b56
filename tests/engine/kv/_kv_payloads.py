"""KV payloads and hand-made frames for the codec tests: a fingerprint, a seeded payload, a frame cut into
its msgpack header and tensor body and put back together."""

from __future__ import annotations

import struct

import msgpack
import torch

from pdserve.engine.kv.codec import KvPayload, ModelFingerprint, pack_kv

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
