"""The KV data connection (``--kv-transport tcp``) between real workers on loopback: the same KV lands
as through gRPC's PushKv; refusals carry PushKv's codes and reasons and end the push at once; a push
cut at any frame, stalled past its deadline or sent without the cluster secret leaves no block
behind; bytes that are not records close only their own connection; a worker that comes back on
another port is found again."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv import tcp_wire as wire
from pdserve.engine.kv.transfer import KvTransferError
from pdserve.prefill_worker.kv_sender import GrpcKvSender
from pdserve.prefill_worker.kv_tcp_sender import TcpKvSender
from pdserve.rpc.auth import SECRET_ENV
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.test_kv_layer_stream import decoded_kv, frames_for, used_blocks


@pytest.fixture
async def decode(embedded_dir):
    import pdserve.decode_worker.worker as decode_worker

    running = await decode_worker.serve(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, dtype="float32"))
    async with grpc.aio.insecure_channel(running.address) as ch:
        yield running, worker_pb2_grpc.DecodeServiceStub(ch)
    await running.stop()


class NoGrpc(GrpcKvSender):
    """Fails the test if a push goes through gRPC."""

    async def send_kv(self, *args):
        raise AssertionError("pushed through gRPC")

    send_kv_stream = send_kv


async def waiting(stub, rid: str, kv_timeout_s: float = 10):
    stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=kv_timeout_s))
    await stream.initial_metadata()
    return stream


async def stream_error(stream) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stream:
            pass
    return info.value.details()


async def frames(items, then_wait: bool = False):
    for item in items:
        yield item
    if then_wait:
        await asyncio.Event().wait()


async def test_the_decode_cache_holds_the_same_kv_through_tcp_and_grpc(embedded_dir):
    tokens_grpc, kv_grpc = await decoded_kv(embedded_dir, "layer", kv_transport="grpc")
    tokens_tcp, kv_tcp = await decoded_kv(embedded_dir, "layer", kv_transport="tcp")
    assert tokens_tcp == tokens_grpc
    for a, b in zip(kv_grpc, kv_tcp):
        assert torch.equal(a, b)


async def test_pushes_go_over_tcp_and_reuse_the_connection(decode):
    running, stub = decode
    sender = TcpKvSender(NoGrpc())
    stats = await worker_pb2_grpc.WorkerServiceStub(grpc.aio.insecure_channel(running.address)).GetStats(
        worker_pb2.GetStatsRequest()
    )
    assert stats.kv_tcp_port > 0
    try:
        for i in range(3):
            rid = f"ok-{i}"
            stream = await waiting(stub, rid)
            await sender.send_kv_stream(running.address, rid, frames(frames_for(running.worker.engine, rid)))
            assert sum(len(b.token_ids) for b in [b async for b in stream]) == 3
        assert len(sender._idle[running.address]) == 1  # one connection carried the three pushes
        assert await used_blocks(running.worker) == 0
    finally:
        await sender.close()


async def test_refusals_carry_pushkv_codes_and_end_the_push_at_once(decode):
    running, stub = decode
    engine, sender = running.worker.engine, TcpKvSender(NoGrpc())
    try:
        with pytest.raises(KvTransferError) as info:  # nobody waits for it
            await sender.send_kv(running.address, "ghost", frames_for(engine, "ghost")[0])
        assert info.value.code == "NOT_FOUND" and "ghost" in info.value.reason
        stream = await waiting(stub, "bad")
        damaged = frames_for(engine, "bad")
        damaged[1] = damaged[1][:-1] + bytes([damaged[1][-1] ^ 0xFF])
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(KvTransferError) as info:  # the next frame never comes: the refusal ends the push
            await sender.send_kv_stream(running.address, "bad", frames(damaged[:2], then_wait=True))
        assert loop.time() - start < 5
        assert info.value.code == "INVALID_ARGUMENT" and "checksum" in info.value.reason
        assert "checksum" in await stream_error(stream)
        assert await used_blocks(running.worker) == 0
    finally:
        await sender.close()


async def test_a_push_cut_at_any_frame_or_stalled_leaves_no_block(decode):
    running, stub = decode
    engine = running.worker.engine
    count = len(frames_for(engine, "x"))
    for k in range(1, count):  # the sender goes away after k frames
        rid = f"cut-{k}"
        stream = await waiting(stub, rid)
        sender = TcpKvSender(NoGrpc())
        push = asyncio.ensure_future(
            sender.send_kv_stream(running.address, rid, frames(frames_for(engine, rid)[:k], True))
        )
        await asyncio.sleep(0.2)
        push.cancel()
        await asyncio.gather(push, return_exceptions=True)
        assert "truncated stream" in await stream_error(stream)
        assert await used_blocks(running.worker) == 0
        await sender.close()
    stream = await waiting(stub, "stalled")
    sender = TcpKvSender(NoGrpc(timeout_s=0.5, stream_timeout_s=0.5))
    with pytest.raises(KvTransferError) as info:
        await sender.send_kv_stream(running.address, "stalled", frames(frames_for(engine, "stalled")[:2], True))
    assert info.value.code == "DEADLINE_EXCEEDED"
    await stream_error(stream)
    assert await used_blocks(running.worker) == 0
    await sender.close()


async def test_the_cluster_secret_is_required(embedded_dir, monkeypatch):
    import pdserve.decode_worker.worker as decode_worker

    monkeypatch.setenv(SECRET_ENV, "kv-secret")
    running = await decode_worker.serve(EngineConfig(model=str(embedded_dir), num_kv_blocks=64, dtype="float32"))
    try:
        from pdserve.rpc.auth import internal_channel

        async with internal_channel(running.address, None) as ch:
            stub = worker_pb2_grpc.DecodeServiceStub(ch)
            port = (await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())).kv_tcp_port
            stream = await waiting(stub, "r")
            monkeypatch.setenv(SECRET_ENV, "a-wrong-one")
            stranger = TcpKvSender(NoGrpc())
            stranger._ports[running.address] = port
            with pytest.raises(KvTransferError) as info:
                await stranger.send_kv_stream(running.address, "r", frames(frames_for(running.worker.engine, "r")))
            assert info.value.code == "UNAUTHENTICATED"
            monkeypatch.setenv(SECRET_ENV, "kv-secret")
            sender = TcpKvSender(NoGrpc())
            await sender.send_kv_stream(running.address, "r", frames(frames_for(running.worker.engine, "r")))
            assert sum(len(b.token_ids) for b in [b async for b in stream]) == 3
            await asyncio.gather(stranger.close(), sender.close())
    finally:
        await running.stop()


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n", wire.PREFACE + bytes([9, 0, 0, 0, 0]), wire.PREFACE + wire.header(wire.DATA, 1 << 30)],
    ids=["http", "unknown-kind", "oversized"],
)
async def test_bytes_that_are_not_records_close_only_their_connection(decode, garbage):
    running, stub = decode
    sender = TcpKvSender(NoGrpc())
    await sender._port(running.address)
    reader, writer = await asyncio.open_connection("127.0.0.1", sender._ports[running.address])
    writer.write(garbage)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the worker
    writer.close()
    stream = await waiting(stub, "after")
    await sender.send_kv_stream(running.address, "after", frames(frames_for(running.worker.engine, "after")))
    assert sum(len(b.token_ids) for b in [b async for b in stream]) == 3
    await sender.close()


async def test_a_worker_back_on_another_port_is_found_again(decode):
    running, stub = decode
    sender = TcpKvSender(NoGrpc())
    old = await sender._port(running.address)
    await running.kv_tcp.stop()
    assert await running.kv_tcp.start("127.0.0.1") != old  # GetStats names the new port from now on
    stream = await waiting(stub, "moved")
    await sender.send_kv_stream(running.address, "moved", frames(frames_for(running.worker.engine, "moved")))
    assert sum(len(b.token_ids) for b in [b async for b in stream]) == 3
    assert sender._ports[running.address] == running.kv_tcp.port
    await sender.close()


def test_the_transport_is_a_flag_and_a_wrong_one_is_named():
    import argparse

    from pdserve.worker.flags import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([]), device="cpu").kv_transport == "tcp"
    assert engine_config_from_args(parser.parse_args(["--kv-transport", "grpc"]), device="cpu").kv_transport == "grpc"
    with pytest.raises(ValueError, match="kv_transport must be one of tcp, grpc, got 'udp'"):
        EngineConfig(model="embedded", kv_transport="udp")


async def test_idle_connections_are_closed_and_not_reused_when_old(decode, monkeypatch):
    import pdserve.decode_worker.kv_tcp as kv_tcp
    import pdserve.prefill_worker.kv_tcp_sender as kv_tcp_sender

    running, stub = decode
    monkeypatch.setattr(kv_tcp, "IDLE_CLOSE_S", 0.3)
    sender = TcpKvSender(NoGrpc())
    reader, writer = await asyncio.open_connection("127.0.0.1", await sender._port(running.address))
    writer.write(wire.PREFACE)  # a connection that starts no push
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the worker
    writer.close()
    stream = await waiting(stub, "first")
    await sender.send_kv_stream(running.address, "first", frames(frames_for(running.worker.engine, "first")))
    (old,) = sender._idle[running.address]
    monkeypatch.setattr(kv_tcp_sender, "POOL_IDLE_S", 0.0)  # the pooled connection is now too old
    stream2 = await waiting(stub, "second")
    await sender.send_kv_stream(running.address, "second", frames(frames_for(running.worker.engine, "second")))
    (new,) = sender._idle[running.address]
    assert new[1] is not old[1] and old[1].is_closing()
    for s in (stream, stream2):
        assert sum(len(b.token_ids) for b in [b async for b in s]) == 3
    await sender.close()
