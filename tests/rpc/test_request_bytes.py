"""Request bytes that do not parse as the method's message, sent raw to servers from ``start_server``
on 127.0.0.1: the call ends INVALID_ARGUMENT with a readable message, nothing is logged at ERROR
level, and the server goes on serving."""

from __future__ import annotations

import logging

import grpc
import pytest

from pdserve.router.frontend import Frontend
from pdserve.router.grpc_api import GENERATE_SERVICE, RouterServicer
from pdserve.router.pool import WorkerPool
from pdserve.rpc.auth import require_api_key
from pdserve.rpc.server import start_server
from pdserve.v1 import generate_pb2 as PB
from pdserve.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc

CORRUPT = b"\xff\xff\xff"
BAD_UTF8_PROMPT = b"\x12\x02\xff\xfe"  # GenerateRequest.prompt (field 2) holding bytes that are not UTF-8
GENERATE = "/pdserve.v1.GenerateService/Generate"
MODEL_INFO = "/pdserve.v1.GenerateService/GetModelInfo"
PUSH_KV = "/pdserve.v1.DecodeService/PushKv"
REFLECTION = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
WAIT_S = 10


@pytest.fixture
async def router(embedded_dir):
    """The router's GenerateService as ``router.grpc_api.serve`` starts it; yields a function
    (interceptors -> address) and stops what it started."""
    pool = WorkerPool([], [], ["127.0.0.1:9"])  # never called
    core = Frontend(embedded_dir, pool, 256, model_name="test-model")
    servers = []

    async def start(interceptors=None) -> str:
        register = [(generate_pb2_grpc.add_GenerateServiceServicer_to_server, RouterServicer(core), GENERATE_SERVICE)]
        server, port = await start_server(register, interceptors=interceptors)
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)
    await pool.close()


@pytest.fixture
def errors(caplog):
    """The records gRPC and pdserve logged at ERROR level or above, as the test goes (asyncio's own,
    such as a poller thread of an earlier test's closed event loop, are not the server's)."""
    caplog.set_level(logging.DEBUG)
    return lambda: [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("grpc", "pdserve"))]


async def raw_call(address: str, path: str, kind: str, *messages: bytes, metadata=None) -> list:
    """A call of ``kind`` that sends ``messages`` as they are (no serializer); the responses' raw bytes."""
    async with grpc.aio.insecure_channel(address) as channel:
        method = getattr(channel, kind)(path)
        if kind.startswith("unary_"):
            call = method(messages[0], timeout=WAIT_S, metadata=metadata)
        else:
            call = method(iter(messages), timeout=WAIT_S, metadata=metadata)
        if kind.endswith("_unary"):
            return [await call]
        return [m async for m in call]


@pytest.mark.parametrize(
    "path, kind, sent, words",
    [
        (GENERATE, "unary_stream", CORRUPT, "request is not a valid pdserve.v1.GenerateRequest (3 bytes)"),
        (GENERATE, "unary_stream", BAD_UTF8_PROMPT, "pdserve.v1.GenerateRequest (4 bytes): String field had bad UTF-8"),
        (MODEL_INFO, "unary_unary", CORRUPT, "request is not a valid pdserve.v1.GetModelInfoRequest (3 bytes)"),
        (REFLECTION, "stream_stream", CORRUPT, "ServerReflectionRequest (3 bytes): Wire format was corrupt"),
    ],
)
async def test_the_router_refuses_undecodable_requests_and_goes_on(router, errors, path, kind, sent, words):
    address = await router()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_call(address, path, kind, sent)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert words in info.value.details()
    assert "Traceback" not in info.value.details() and "Unexpected" not in info.value.details()
    assert errors() == []
    async with grpc.aio.insecure_channel(address) as channel:  # still serving
        info = await generate_pb2_grpc.GenerateServiceStub(channel).GetModelInfo(PB.GetModelInfoRequest())
    assert info.model == "test-model"


async def test_an_api_key_is_checked_before_the_request_bytes(router, errors):
    address = await router([require_api_key(("k1",))])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_call(address, GENERATE, "unary_stream", CORRUPT)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await raw_call(address, GENERATE, "unary_stream", CORRUPT, metadata=(("authorization", "Bearer k1"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors() == []


class Pushes(worker_pb2_grpc.DecodeServiceServicer):
    """PushKv that records the chunks it read and what ended its loop, then lets that out."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.failures: list[Exception] = []

    async def PushKv(self, request_iterator, context):
        try:
            async for chunk in request_iterator:
                self.request_ids.append(chunk.request_id)
        except Exception as exc:
            self.failures.append(exc)
            raise
        return worker_pb2.PushKvResponse(received_bytes=len(self.request_ids))


async def test_a_bad_message_in_a_request_stream_reaches_the_servicer_then_ends_the_call(errors):
    servicer = Pushes()
    server, port = await start_server(
        [(worker_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, "pdserve.v1.DecodeService")]
    )
    try:
        good = worker_pb2.KvChunk(request_id="r1", data=b"x").SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_call(f"127.0.0.1:{port}", PUSH_KV, "stream_unary", good, CORRUPT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request is not a valid pdserve.v1.KvChunk (3 bytes)" in info.value.details()
        assert servicer.request_ids == ["r1"]  # the servicer read the good chunk, then saw the bad one fail
        assert [type(e).__mro__[1] for e in servicer.failures] == [ValueError]
        assert errors() == []
        response = await raw_call(f"127.0.0.1:{port}", PUSH_KV, "stream_unary", good, good)
        assert worker_pb2.PushKvResponse.FromString(response[0]).received_bytes == 3
    finally:
        await server.stop(0)
