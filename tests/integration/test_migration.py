"""Migration and the KV lease (split placement): a decode worker that dies mid-stream moves the
request to a live one and the client's stream goes on with no duplicated or missing token; a
prefill worker that dies, or a KV push that fails, before decode has the KV ends the decode wait at
once (a migration, or a clear error)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.client import Client, make_request
from pdserve.router.split_backend import MAX_MIGRATIONS
from pdserve.rpc.auth import SECRET_ENV
from pdserve.v1 import generate_pb2 as PB
from tests.integration._pipeline import local_pipeline


async def _stream_and_kill(pipe, client, request, kill_after: int):
    """Stream ``request``; after ``kill_after`` tokens, stop the decode worker that serves it."""
    tokens, text, error, killed = [], [], None, None
    async for msg in client.stream(request, timeout=60):
        kind = msg.WhichOneof("kind")
        if kind == "chunk":
            tokens += msg.chunk.token_ids
            text.append(msg.chunk.text)
            if killed is None and len(tokens) >= kill_after:
                busy = [h for h in pipe.router.core.pool.workers if h.role == "decode" and h.active_requests]
                killed = next(w for w in pipe.workers if w.address == busy[0].address)
                await killed.server.stop(0)
        elif kind == "complete":
            text.append(msg.complete.text)
            finish = msg.complete.finish_reason
        else:
            error = msg.error
    return tokens, "".join(text), error, killed, finish if error is None else None


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=1234, top_k=50)])
async def test_a_stream_survives_its_decode_worker(embedded_dir, sampling):
    request = dict(prompt="Once upon a time there was", max_tokens=48, ignore_eos=True, **sampling)
    async with local_pipeline(embedded_dir, "split", num_decode=2) as pipe, Client(pipe.address) as client:
        ref = await client.generate(make_request(**request))
        assert len(ref.token_ids) == 48
        tokens, text, error, killed, finish = await _stream_and_kill(pipe, client, make_request(**request), 10)
        assert error is None and killed is not None
        assert tokens == ref.token_ids and text == ref.text  # nothing lost, nothing twice
        assert finish == PB.FINISH_REASON_LENGTH
        assert pipe.router.core.metrics.migrations._value.get() == 1


async def test_without_a_live_decode_worker_the_stream_ends_with_an_error_soon(embedded_dir):
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        loop = asyncio.get_running_loop()
        t = loop.time()
        tokens, _, error, killed, _ = await _stream_and_kill(
            pipe, client, make_request("Once upon a time", max_tokens=400, ignore_eos=True, temperature=0), 5
        )
        assert error is not None and error.code == "UNAVAILABLE" and killed is not None
        assert loop.time() - t < 8.0  # the migration waits up to 4 s for a live worker, then gives up


async def test_a_prefill_worker_that_dies_before_its_kv_arrives_is_noticed_at_once(embedded_dir):
    """Its first token came back, its KV push never will: the router sees the prefill worker die
    and ends the decode wait at once (migrating when it can; here no prefill worker is left, so
    the stream ends with UNAVAILABLE within seconds, not after decode's 300 s KV timeout)."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        prefill_w = pipe.workers[0]
        pushed = asyncio.Event()

        async def never_push(target, request_id, frame):
            pushed.set()
            await asyncio.sleep(3600)

        async def never_push_stream(target, request_id, frames):  # a layer-wise push: frames up to the last
            async for _ in frames:
                pass
            await never_push(target, request_id, None)

        prefill_w.worker.kv_sender.send_kv = never_push
        prefill_w.worker.kv_sender.send_kv_stream = never_push_stream
        loop = asyncio.get_running_loop()
        t = loop.time()
        first = asyncio.Event()

        async def consume() -> tuple[list[int], str]:
            tokens, error = [], ""
            async for msg in client.stream(make_request("Once upon a time", max_tokens=20, temperature=0)):
                kind = msg.WhichOneof("kind")
                if kind == "chunk" and msg.chunk.token_ids:
                    tokens += msg.chunk.token_ids
                    first.set()
                elif kind == "error":
                    error = f"{msg.error.code}: {msg.error.message}"
            return tokens, error

        task = asyncio.create_task(consume())
        await asyncio.wait_for(pushed.wait(), 10)
        # the first token must have reached the router before the worker dies: one still in flight
        # on the Prefill stream would make this a death before the first token (migrated, or
        # refused with UNAVAILABLE when no prefill worker is left), which is another case
        await asyncio.wait_for(first.wait(), 10)
        await prefill_w.server.stop(0)
        tokens, error = await asyncio.wait_for(task, 15)
        assert "UNAVAILABLE" in error and "died before its KV" in error
        assert len(tokens) == 1 and loop.time() - t < 10
        decode = pipe.workers[1].worker.engine
        assert decode.blocks.num_used == 0 and not decode.scheduler.has_work()


async def test_a_kv_push_that_decode_never_sees_ends_the_decode_wait_at_once(embedded_dir, monkeypatch):
    """Both workers alive, but the prefill worker's pushes carry a stale cluster secret, so the
    decode worker's door refuses them before its PushKv handler (and the waiting Decode stream)
    learns of them. The prefill worker says so on its Prefill stream and the router cancels the
    decode wait at once: the client gets an INTERNAL error within a second or two (not after
    decode's 300 s KV timeout), no worker leaves routing, and neither holds a KV block."""
    monkeypatch.setenv(SECRET_ENV, "the-cluster-secret")
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        monkeypatch.setenv(SECRET_ENV, "a-stale-secret")  # read when the prefill worker first dials decode
        loop = asyncio.get_running_loop()
        t = loop.time()
        res = await asyncio.wait_for(client.generate(make_request("Once upon a time", max_tokens=20)), 10)
        assert loop.time() - t < 2.0
        assert res.error.startswith("INTERNAL") and "did not reach the decode worker: UNAUTHENTICATED" in res.error
        assert len(res.token_ids) == 1 and pipe.router.core.metrics.migrations._value.get() == 0
        assert all(w.healthy for w in pipe.router.core.pool.workers)
        monkeypatch.setenv(SECRET_ENV, "the-cluster-secret")  # for the test's own stats calls
        assert await pipe.wait_idle() == 0
        decode = pipe.workers[1].worker
        assert decode.engine.blocks.num_used == 0 and not decode._pending


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
async def test_a_kv_push_that_cannot_reach_decode_migrates_at_once(embedded_dir, monkeypatch, transport):
    """The decode worker is alive for the router but unreachable from the prefill worker (its
    pushes dial a closed port, as across a network partition): each try's lease is lost at once and
    the request migrates; with every try spent the client gets UNAVAILABLE within a second or two,
    no worker has left routing, and no KV block stays used."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    async with local_pipeline(embedded_dir, "split", kv_transport=transport) as pipe, Client(pipe.address) as client:
        sender = pipe.workers[0].worker.kv_sender
        if transport == "tcp":  # the KV port it asks for is closed too
            dial, name = sender._dial, "_dial"
            monkeypatch.setattr(sender, "_dial", lambda host, port: dial("127.0.0.1", int(closed.split(":")[1])))
        else:
            dial, name = sender._push_kv, "_push_kv"
            monkeypatch.setattr(sender, "_push_kv", lambda target: dial(closed))
        loop = asyncio.get_running_loop()
        t = loop.time()
        res = await asyncio.wait_for(client.generate(make_request("Once upon a time", max_tokens=20)), 10)
        assert loop.time() - t < 2.0
        assert res.error.startswith("UNAVAILABLE") and "did not reach the decode worker: UNAVAILABLE" in res.error
        assert len(res.token_ids) == MAX_MIGRATIONS + 1  # each try's first token, then the error
        assert pipe.router.core.metrics.migrations._value.get() == MAX_MIGRATIONS
        assert all(w.healthy for w in pipe.router.core.pool.workers)
        assert await pipe.wait_idle() == 0
        monkeypatch.setattr(sender, name, dial)
        ok = await client.generate(make_request("hello again", max_tokens=4, ignore_eos=True))
        assert len(ok.token_ids) == 4 and not ok.error


async def test_a_deadline_that_passes_during_the_kv_push_migrates_nothing(embedded_dir):
    """The request's own deadline ends its Prefill stream while the push hangs: the client gets
    DEADLINE_EXCEEDED, and the router neither retries the request nor takes a worker out of routing."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:

        async def hanging_push(target, request_id, frame):
            await asyncio.sleep(3600)

        pipe.workers[0].worker.kv_sender.send_kv = pipe.workers[0].worker.kv_sender.send_kv_stream = hanging_push
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(make_request("Once upon a time", max_tokens=20), timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.5)  # the router's side of the same deadline
        assert pipe.router.core.metrics.migrations._value.get() == 0
        assert all(w.healthy for w in pipe.router.core.pool.workers) and not pipe.router.core.inflight
