"""Bad input, cancellation, aborts and refused KV: clear errors, other requests unharmed, no block leaks."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine.kv.codec import KvPayload, ModelFingerprint, pack_kv
from pdserve.router.client import Client, make_request
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration._pipeline import local_pipeline

BAD_REQUESTS = [
    (make_request(""), "prompt is empty"),
    (make_request("hello", max_tokens=0), "max_tokens must be >= 1"),
    (make_request("hello", temperature=-1.0), "temperature must be"),
    (make_request("hello", temperature=float("nan")), "NaN"),
    (make_request("hello", top_p=0.0), "top_p must be in (0, 1]"),
    (make_request("hello", top_p=1.5), "top_p must be in (0, 1]"),
    (make_request("hello", top_k=-3), "top_k must be >= 0"),
    (make_request("hello", max_tokens=5000), "exceeds the context window"),
    (make_request("word " * 3000), "context window"),
    (make_request("", prompt_token_ids=[5, 10**6]), "out of range"),
    (make_request("hello", stop=[""]), "stop strings must be non-empty"),
    (make_request("hello", request_id="x" * 100_000), "request_id has 100000 characters; at most 256"),
]


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_bad_requests_get_invalid_argument_and_service_continues(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        for req, needle in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(req)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert needle in info.value.details(), (needle, info.value.details())
            ok = await client.generate(make_request("still serving?", max_tokens=3, ignore_eos=True))
            assert len(ok.token_ids) == 3
        assert await pipe.wait_idle() == 0


async def test_duplicate_request_id_refused(embedded_dir):
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        # in flight for sure: its first tokens arrived, and 1,500 more take far longer than one refusal
        first = client.stream(make_request("a", max_tokens=1500, ignore_eos=True, request_id="dup"))
        head = await anext(first)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(make_request("b", max_tokens=2, request_id="dup"))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        rest = [m async for m in first]
        assert sum(len(m.chunk.token_ids) for m in [head, *rest] if m.HasField("chunk")) == 1500


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_cancel_and_abort_free_every_block(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        long = make_request("a long answer please " * 20, max_tokens=1500, ignore_eos=True)
        # client-side cancellation after two chunks
        call = client.stub.Generate(long)
        got = 0
        async for _ in call:
            got += 1
            if got == 2:
                call.cancel()
                break
        # Abort RPC on another in-flight request, once it streams; a third request runs meanwhile
        aborted_req = make_request("abort me " * 30, max_tokens=1500, ignore_eos=True, request_id="victim")
        streaming = asyncio.Event()
        victim = asyncio.create_task(client.generate(aborted_req, on_text=lambda _: streaming.set()))
        bystander = asyncio.create_task(client.generate(make_request("bystander", max_tokens=30, ignore_eos=True)))
        await asyncio.wait_for(streaming.wait(), 30)
        assert await client.abort("victim")
        res = await victim
        assert res.finish_reason == "abort"
        assert 0 < len(res.token_ids) < 1500
        assert len((await bystander).token_ids) == 30
        assert await client.abort("unknown-id") is False
        assert await pipe.wait_idle() == 0


async def test_health_and_reflection_on_every_server(embedded_dir):
    """Reflection v1 (what grpcurl asks first) and v1alpha list exactly what each server serves."""
    from google.protobuf import descriptor_pb2

    common = {
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    expected = [
        {"pdserve.v1.GenerateService"},
        {"pdserve.v1.PrefillService", "pdserve.v1.WorkerService"},
        {"pdserve.v1.DecodeService", "pdserve.v1.ColocatedService", "pdserve.v1.WorkerService"},
    ]
    async with local_pipeline(embedded_dir, "split") as pipe:
        for address, services in zip([pipe.address] + [w.address for w in pipe.workers], expected):
            async with grpc.aio.insecure_channel(address) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                v1 = ch.stream_stream(
                    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )
                v1alpha = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo
                for call in (v1, v1alpha):
                    replies = [
                        r
                        async for r in call(
                            iter(
                                [
                                    reflection_pb2.ServerReflectionRequest(list_services=""),
                                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=sorted(services)[0]),
                                ]
                            )
                        )
                    ]
                    assert {s.name for s in replies[0].list_services_response.service} == services | common
                    files = [
                        descriptor_pb2.FileDescriptorProto.FromString(b)
                        for b in replies[1].file_descriptor_response.file_descriptor_proto
                    ]
                    assert files[0].package == "pdserve.v1" and files[0].name.startswith("pdserve/v1/")
                described = [
                    r
                    async for r in v1(
                        iter(
                            [
                                reflection_pb2.ServerReflectionRequest(
                                    file_containing_symbol="grpc.reflection.v1.ServerReflection"
                                )
                            ]
                        )
                    )
                ]
                assert described[0].file_descriptor_response.file_descriptor_proto


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


async def test_kv_push_is_chunked(stories_dir, monkeypatch):
    """A long prompt's KV crosses as several messages of <= chunk_bytes (gRPC's 4 MiB limit is never hit)."""
    import pdserve.prefill_worker.kv_sender as kv_sender

    chunks: list[int] = []
    real = kv_sender.iter_chunks

    def recording(frame, chunk_bytes):
        for piece in real(frame, chunk_bytes):
            chunks.append(len(piece))
            yield piece

    monkeypatch.setattr(kv_sender, "iter_chunks", recording)
    async with local_pipeline(stories_dir, "split") as pipe, Client(pipe.address) as client:
        pipe.workers[0].worker.kv_sender.chunk_bytes = 64 << 10
        res = await client.generate(make_request("Once upon a time " * 100, max_tokens=5, temperature=0))
        assert len(res.token_ids) == 5
        assert res.timings.kv_transfer_ns > 0
    assert len(chunks) > 4 and max(chunks) <= 64 << 10


async def test_unexpected_admission_failure_ends_the_request_at_once(embedded_dir):
    """A bug on the decode side must fail the client's stream promptly, not after the KV timeout."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        engine = pipe.workers[1].worker.engine
        engine.admit_kv = lambda payload, preempt=False: (_ for _ in ()).throw(RuntimeError("disk on fire"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await client.generate(make_request("hello there", max_tokens=8))
        assert loop.time() - t0 < 10
        assert res.finish_reason == "error" and "disk on fire" in res.error
        assert len(res.token_ids) == 1  # the first token came from prefill before the failure
        ok = await client.generate(make_request("hello again", max_tokens=1))
        assert len(ok.token_ids) == 1
        assert await pipe.wait_idle() == 0


async def test_context_window_is_capped_by_the_kv_cache(embedded_dir):
    """The router advertises and enforces what a worker's KV cache can hold, not only the model's."""
    async with (
        local_pipeline(embedded_dir, "split", num_kv_blocks=20, block_size=16) as pipe,
        Client(pipe.address) as client,
    ):
        assert (await client.model_info()).max_model_len == 320
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(make_request("", prompt_token_ids=[5] * 300, max_tokens=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context window of 320 tokens" in info.value.details()
        ok = await client.generate(make_request("", prompt_token_ids=[5] * 300, max_tokens=20, ignore_eos=True))
        assert len(ok.token_ids) == 20


async def test_router_health_says_not_serving_while_a_pool_has_no_worker(embedded_dir):
    """Readiness tells the truth: a split router with no live prefill worker is NOT_SERVING."""
    async with local_pipeline(embedded_dir, "split") as pipe, grpc.aio.insecure_channel(pipe.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status(service: str) -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status("") == await status("pdserve.v1.GenerateService") == health_pb2.HealthCheckResponse.SERVING
        await pipe.workers[0].stop()  # the prefill worker
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while await status("") == health_pb2.HealthCheckResponse.SERVING and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("pdserve.v1.GenerateService") == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_a_failed_call_takes_the_worker_out_of_routing_at_once(embedded_dir, placement):
    """No waiting for three failed stats polls: the UNAVAILABLE call itself marks the worker down."""
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        dead = pipe.workers[0]  # the prefill worker, or the only colocated one
        handle = next(w for w in pipe.router.core.pool.workers if w.address == dead.address)
        await dead.stop()
        request = asyncio.create_task(client.generate(make_request("hi", max_tokens=2)))
        for _ in range(50):  # split placement then waits (up to 4 s) for a live worker to migrate to
            if request.done() or not handle.healthy:
                break
            await asyncio.sleep(0.005)
        assert not handle.healthy and handle.failed_polls < 3
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await request
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


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
    finally:
        await p.stop()
        await d.stop()


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_shutdown_ends_streams_with_an_error_message(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        stream = asyncio.create_task(client.generate(make_request("hi", max_tokens=2000, ignore_eos=True)))
        await asyncio.sleep(0.5)
        await pipe.router.stop()
        res = await asyncio.wait_for(stream, 10)
        assert res.error and "UNAVAILABLE" in res.error and "shutting down" in res.error
        assert 0 < len(res.token_ids) < 2000
