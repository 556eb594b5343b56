"""The layer-wise KV hand-off over real gRPC on loopback: the decode worker's cache holds exactly the
whole frame's KV; a stream that breaks at any frame leaves no block behind and ends with a clear
error; a full cache, a request finished by its first token and a chunked prefill all work."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.codec import KvPayload, frame_parts
from pdserve.engine.kv.layer_frames import stream_frames
from pdserve.engine.params import SamplingParams
from pdserve.router.client import Client, make_request
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration._pipeline import local_pipeline

PROMPTS = [list(range(7, 7 + n)) for n in (1, 15, 16, 17, 120)]


async def decoded_kv(embedded_dir, kv_stream: str, **engine_kw) -> tuple[list, list]:
    """Greedy tokens of PROMPTS and the prompt KV the decode worker held when it admitted each."""
    async with local_pipeline(embedded_dir, "split", kv_stream=kv_stream, **engine_kw) as pipe:
        engine = pipe.workers[1].worker.engine
        kv, admit = {}, engine.admit_reserved

        def capture(seq, first_token):  # on the engine thread, as the sequence enters the batch
            kv[seq.request_id] = engine.runner.read_kv(seq, seq.num_tokens).clone()
            return admit(seq, first_token)

        engine.admit_reserved = capture
        async with Client(pipe.address) as client:
            results = await asyncio.gather(
                *[
                    client.generate(
                        make_request("", prompt_token_ids=p, max_tokens=6, temperature=0, request_id=f"r{i}")
                    )
                    for i, p in enumerate(PROMPTS)
                ]
            )
        assert await pipe.wait_idle() == 0
    return [r.token_ids for r in results], [kv[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [None, 32])
async def test_the_decode_cache_holds_the_whole_frame_kv_bit_for_bit(embedded_dir, dtype, chunk):
    """chunk: --max-num-batched-tokens, so that the 120-token prompt streams in four rounds."""
    kw = {"dtype": dtype} if chunk is None else {"dtype": dtype, "max_num_batched_tokens": chunk}
    tokens_whole, kv_whole = await decoded_kv(embedded_dir, "whole", **kw)
    tokens_layer, kv_layer = await decoded_kv(embedded_dir, "layer", **kw)
    assert tokens_layer == tokens_whole
    for a, b in zip(kv_whole, kv_layer):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
async def decode(embedded_dir):
    import pdserve.decode_worker.worker as decode_worker

    running = await decode_worker.serve(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, dtype="float32"))
    async with grpc.aio.insecure_channel(running.address) as ch:
        yield running.worker, worker_pb2_grpc.DecodeServiceStub(ch)
    await running.stop()


def frames_for(engine, rid: str, n: int = 40) -> list[bytes]:
    fp = engine.fingerprint
    kv = torch.randn(fp.num_layers, 2, n, fp.num_kv_heads, fp.head_dim)
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True).to_dict()
    payload = KvPayload(rid, fp, list(range(3, 3 + n)), 9, sampling, kv)
    return [b"".join(bytes(p) for p in frame_parts(f)) for f in stream_frames(payload, [16, n - 16])]


def chunks(rid: str, frames: list[bytes]) -> list:
    return [worker_pb2.KvChunk(request_id=rid if i == 0 else "", data=f) for i, f in enumerate(frames)]


async def used_blocks(worker, timeout_s: float = 5.0) -> int:
    """The decode engine's used blocks once they drop to 0 (releases run on its thread), or after the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while worker.engine.blocks.num_used and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return worker.engine.blocks.num_used


async def test_a_stream_cut_at_any_frame_leaves_no_block_and_says_so(decode):
    worker, stub = decode
    count = len(frames_for(worker.engine, "x"))
    for k in range(1, count):  # half-closed after k frames
        rid = f"cut-{k}"
        stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=10))
        await stream.initial_metadata()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PushKv(iter(chunks(rid, frames_for(worker.engine, rid)[:k])))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "truncated stream" in info.value.details() and "without its end frame" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        assert "truncated stream" in info.value.details()
        assert await used_blocks(worker) == 0
    for k in range(1, count):  # the sender goes away after k frames
        rid = f"cancel-{k}"
        stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=0.5))
        await stream.initial_metadata()
        sent = asyncio.Event()

        async def some_frames(k=k, rid=rid, sent=sent):
            for chunk in chunks(rid, frames_for(worker.engine, rid)[:k]):
                yield chunk
            sent.set()
            await asyncio.Event().wait()

        call = stub.PushKv(some_frames())
        await sent.wait()
        deadline = asyncio.get_running_loop().time() + 10  # the head's reservation runs on the engine thread
        while not worker.engine.blocks.num_used and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert worker.engine.blocks.num_used > 0  # the head reserved the blocks
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        # the stream's cut (or, had the handler been cancelled before it saw the cut, the KV wait)
        assert "truncated stream" in info.value.details() or "no KV cache arrived" in info.value.details()
        assert await used_blocks(worker) == 0
    rid = "whole-stream"  # and the worker still admits a stream
    stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=10))
    await stream.initial_metadata()
    await stub.PushKv(iter(chunks(rid, frames_for(worker.engine, rid))))
    assert sum(len(b.token_ids) for b in [b async for b in stream]) == 3  # the first came with prefill
    assert await used_blocks(worker) == 0


async def test_damaged_reordered_and_duplicated_layer_frames_are_refused(decode):
    worker, stub = decode
    cases = {  # frames by index: the head, 4 layers of 16 positions, 4 of 24, the end
        "checksum mismatch in layer 2": [0, 1, 2, 3],  # the last one damaged
        "out of order: got layer 2, expected layer 1": [0, 1, 3],
        "out of order: got layer 0, expected layer 1": [0, 1, 1],
        "expected positions from 16": [0, 1, 2, 3, 4, 1],
        "ended with missing layers": [0, 1, 2, 3, 4, 5, 6, 9],
    }
    for i, (message, picked) in enumerate(cases.items()):
        rid = f"bad-{i}"
        frames = [frames_for(worker.engine, rid)[j] for j in picked]
        if message.startswith("checksum"):
            frames[-1] = frames[-1][:-1] + bytes([frames[-1][-1] ^ 0x01])
        stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=10))
        await stream.initial_metadata()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.PushKv(iter(chunks(rid, frames)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        assert message in info.value.details()
        assert await used_blocks(worker) == 0


async def test_a_full_decode_cache_delays_a_stream_then_admits_it(embedded_dir):
    """24 blocks of 16 tokens: three 200-token prompts do not fit at once; the streams wait (or
    preempt) for blocks, and every request still decodes exactly as with the whole-frame hand-off."""
    prompts = [[5 + i] * 200 for i in range(3)]
    outputs = {}
    for kv_stream in ("whole", "layer"):
        async with (
            local_pipeline(embedded_dir, "split", kv_stream=kv_stream, num_kv_blocks=24) as pipe,
            Client(pipe.address) as client,
        ):
            results = await asyncio.gather(
                *[
                    client.generate(make_request("", prompt_token_ids=p, max_tokens=40, temperature=0, ignore_eos=True))
                    for p in prompts
                ]
            )
            assert all(not r.error for r in results)
            outputs[kv_stream] = [r.token_ids for r in results]
            assert await pipe.wait_idle() == 0
    assert outputs["layer"] == outputs["whole"]


async def test_a_layer_wise_push_that_failed_during_the_prefill_is_sent_again_whole(embedded_dir):
    from pdserve.engine.kv.transfer import KvTransferError

    async with (
        local_pipeline(embedded_dir, "split", kv_stream="layer") as pipe,
        Client(pipe.address) as client,
    ):
        sender = pipe.workers[0].worker.kv_sender

        async def refused(target, request_id, frames):
            raise KvTransferError("refused", "UNAVAILABLE")

        sender.send_kv_stream = refused
        res = await client.generate(make_request("", prompt_token_ids=PROMPTS[-1], max_tokens=6, temperature=0))
        assert not res.error and len(res.token_ids) == 6 and res.timings.kv_transfer_bytes > 0
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("kv_stream", ["whole", "layer"])
async def test_the_phases_of_a_split_request_add_up_in_either_hand_off(embedded_dir, kv_stream):
    """Decode time counts from the admission and the KV admission wait from the KV's arrival, not
    from the start of the prefill (a layer-wise push reserves its blocks when the prefill starts)."""
    prompt = [7 + i % 200 for i in range(480)]
    async with (
        local_pipeline(embedded_dir, "split", kv_stream=kv_stream) as pipe,
        Client(pipe.address) as client,
    ):
        res = await client.generate(make_request("", prompt_token_ids=prompt, max_tokens=4, temperature=0))
        assert not res.error and len(res.token_ids) == 4
        t = res.timings
        assert t.prefill_ns > 0 and t.decode_ns > 0 and t.kv_transfer_bytes > 0
        assert t.queue_ns + t.prefill_ns + t.kv_transfer_ns + t.decode_ns <= t.total_ns * 1.05
        assert t.kv_admission_ns < t.prefill_ns / 2
        assert await pipe.wait_idle() == 0
