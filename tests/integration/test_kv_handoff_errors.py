"""The KV hand-off from prefill to decode when it goes wrong: refused, damaged or missing KV, another model's
weights, a failed admission; and the push cut into chunks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.kv.codec import KvPayload, ModelFingerprint, pack_kv
from pdserve.router.client import Client, make_request
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration._pipeline import local_pipeline


def _payload(engine_fp: ModelFingerprint, request_id: str, **fp_changes) -> bytes:
    import dataclasses

    import torch

    fp = dataclasses.replace(engine_fp, **fp_changes)
    kv = torch.zeros(fp.num_layers, 2, 3, fp.num_kv_heads, fp.head_dim, dtype=getattr(torch, fp.dtype))
    return pack_kv(
        KvPayload(
            request_id,
            fp,
            [1, 2, 3],
            4,
            {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": 4, "ignore_eos": True},
            kv,
        )
    )


async def test_decode_refuses_bad_kv_and_times_out(embedded_dir):
    async with local_pipeline(embedded_dir, "split") as pipe:
        decode = pipe.workers[1]
        fp = decode.worker.engine.fingerprint
        async with grpc.aio.insecure_channel(decode.address) as ch:
            stub = worker_pb2_grpc.DecodeServiceStub(ch)

            async def push(frame: bytes, rid: str):
                return await stub.PushKv(iter([worker_pb2.KvChunk(request_id=rid, data=frame)]))

            # nobody waits for this request: refused before assembly
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await push(_payload(fp, "ghost"), "ghost")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND

            # wrong fingerprint: the push and the waiting stream both fail with the reason
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="r1", kv_timeout_s=10))
            await stream.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await push(_payload(fp, "r1", num_layers=fp.num_layers + 1), "r1")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "num_layers" in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stream:
                    pass
            assert "num_layers" in info.value.details()

            # corrupted bytes: checksum
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="r2", kv_timeout_s=10))
            await stream.initial_metadata()
            frame = bytearray(_payload(fp, "r2"))
            frame[-1] ^= 0xFF
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await push(bytes(frame), "r2")
            assert "checksum" in info.value.details()
            stream.cancel()

            # no KV at all: bounded wait
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Decode(worker_pb2.DecodeRequest(request_id="r3", kv_timeout_s=0.3)):
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            # a valid frame is admitted and decoded to max_tokens
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="r4", kv_timeout_s=10))
            await stream.initial_metadata()
            await push(_payload(fp, "r4"), "r4")
            tokens = [t for b in [b async for b in stream] for t in b.token_ids]
            assert len(tokens) == 3  # max_tokens 4, the first came from "prefill"
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
async def test_kv_push_is_chunked(stories_dir, monkeypatch, transport):
    """A long prompt's KV crosses as several messages of <= chunk_bytes (gRPC's 4 MiB limit is never
    hit; the KV data connection's DATA records stay under their own limit)."""
    import pdserve.prefill_worker.kv_sender as kv_sender
    import pdserve.prefill_worker.kv_tcp_sender as kv_tcp_sender

    chunks: list[int] = []
    module = kv_tcp_sender if transport == "tcp" else kv_sender
    real = module.iter_chunks

    def recording(frame, chunk_bytes):
        for piece in real(frame, chunk_bytes):
            chunks.append(len(piece))
            yield piece

    monkeypatch.setattr(module, "iter_chunks", recording)
    async with local_pipeline(stories_dir, "split", kv_transport=transport) as pipe, Client(pipe.address) as client:
        pipe.workers[0].worker.kv_sender.chunk_bytes = 64 << 10
        res = await client.generate(make_request("Once upon a time " * 100, max_tokens=5, temperature=0))
        assert len(res.token_ids) == 5
        assert res.timings.kv_transfer_ns > 0
    assert len(chunks) > 4 and max(chunks) <= 64 << 10


async def test_unexpected_admission_failure_ends_the_request_at_once(embedded_dir):
    """A bug on the decode side must fail the client's stream promptly, not after the KV timeout."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        engine = pipe.workers[1].worker.engine
        # the last step of both hand-offs (a whole frame's admit_kv, a layer-wise stream's end frame)
        engine.admit_reserved = lambda seq, first_token: (_ for _ in ()).throw(RuntimeError("disk on fire"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await client.generate(make_request("hello there", max_tokens=8))
        assert loop.time() - t0 < 10
        assert res.finish_reason == "error" and "disk on fire" in res.error
        assert len(res.token_ids) == 1  # the first token came from prefill before the failure
        ok = await client.generate(make_request("hello again", max_tokens=1))
        assert len(ok.token_ids) == 1
        assert await pipe.wait_idle() == 0


def _other_weights(src, dst):
    """A copy of the model folder whose weights differ but whose shapes and tokenizer do not."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(dst / "model.safetensors"))
    return dst


async def test_same_shapes_other_weights_are_refused_at_start_and_per_payload(embedded_dir, tmp_path):
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    from pdserve.engine.config import EngineConfig

    other = _other_weights(embedded_dir, tmp_path / "other")
    p = await prefill.serve(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=64))
    d = await decode.serve(EngineConfig(model=str(other), dtype="float32", num_kv_blocks=64))
    try:
        assert p.worker.engine.fingerprint.mismatches(d.worker.engine.fingerprint)[0].startswith("weights_hash")
        with pytest.raises(RuntimeError, match="different models"):
            await router.serve(embedded_dir, prefill=[p.address], decode=[d.address])
        async with grpc.aio.insecure_channel(d.address) as ch:  # a payload from the other model
            stub = worker_pb2_grpc.DecodeServiceStub(ch)
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="w1", kv_timeout_s=10))
            await stream.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushKv(
                    iter([worker_pb2.KvChunk(request_id="w1", data=_payload(p.worker.engine.fingerprint, "w1"))])
                )
            assert "weights_hash" in info.value.details()
            stream.cancel()
        # through the prefill worker's own push (layer-wise by default): the refusal is what its
        # stream reports, not a later whole-frame push to a Decode stream that has gone
        async with grpc.aio.insecure_channel(d.address) as dch, grpc.aio.insecure_channel(p.address) as pch:
            stream = worker_pb2_grpc.DecodeServiceStub(dch).Decode(
                worker_pb2.DecodeRequest(request_id="w2", kv_timeout_s=10)
            )
            await stream.initial_metadata()
            prefill_call = worker_pb2_grpc.PrefillServiceStub(pch).Prefill(
                worker_pb2.PrefillRequest(
                    request_id="w2",
                    prompt_token_ids=list(range(5, 60)),
                    sampling=worker_pb2.ResolvedSampling(temperature=0, top_p=1, max_tokens=4, ignore_eos=True),
                    decode_address=d.address,
                )
            )
            replies = [r async for r in prefill_call]
            errors = [r.kv_push_error for r in replies if r.HasField("kv_push_error")]
            assert len(errors) == 1 and errors[0].code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
            assert "weights_hash" in errors[0].message
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stream:
                    pass
            assert "weights_hash" in info.value.details()
        assert d.worker.engine.blocks.num_used == 0
    finally:
        await p.stop()
        await d.stop()
