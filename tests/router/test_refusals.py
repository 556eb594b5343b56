"""Refused requests as a client sees them, over HTTP (OpenAI error objects) and gRPC (INVALID_ARGUMENT),
from a router whose worker is never called: validation refuses before any routing."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pdserve.router.frontend import Frontend
from pdserve.router.grpc_api import RouterServicer
from pdserve.router.openai_api import build_app
from pdserve.router.pool import WorkerPool
from pdserve.router.validation import MAX_STOP_CHARS
from pdserve.v1 import generate_pb2 as PB
from pdserve.v1 import generate_pb2_grpc

MAX_MODEL_LEN = 256
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def core(embedded_dir):
    pool = WorkerPool([], [], ["127.0.0.1:9"])  # never called
    yield Frontend(embedded_dir, pool, MAX_MODEL_LEN, model_name="test-model")
    await pool.close()


@pytest.fixture
async def http(core):
    transport = httpx.ASGITransport(app=build_app(core))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        yield client


@pytest.fixture
async def stub(core):
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(RouterServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)
    await server.stop(0)


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 0},
            "max_completion_tokens",
            "max_completion_tokens must be >= 1, got 0",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 3, "max_tokens": 0},
            "max_tokens",
            "max_tokens must be >= 1, got 0",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 1000},
            "max_completion_tokens",
            "+ max_completion_tokens (1000) = ",
        ),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1000}, "max_tokens", "+ max_tokens (1000) = "),
        ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature", "temperature must be"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1"),
        ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "temperature must be"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ("/v1/completions", {"prompt": ""}, "prompt", "prompt is empty"),
        ("/v1/completions", {"prompt": [5, 10**6]}, "prompt", "out of range"),
        ("/v1/completions", {"prompt": "word " * 300}, "prompt", "context window"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "stop strings must be non-empty"),
        (
            "/v1/completions",
            {"prompt": "hi", "stop": ["x" * 200_000] * 16},
            "stop",
            f"stop strings must have at most {MAX_STOP_CHARS} characters",
        ),
    ],
)
async def test_http_errors_name_the_field_sent(http, path, body, param, words):
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    if param == "max_completion_tokens":
        assert "max_tokens" not in err["message"]


async def test_grpc_refuses_prompt_and_prompt_token_ids_together(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(stub.Generate(PB.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2], max_tokens=2)).__aiter__())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt and prompt_token_ids are both set; give one or the other" in info.value.details()


async def test_grpc_refuses_request_ids_with_control_characters(stub):
    request_id = "a\nb\x00c/.."
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(stub.Generate(PB.GenerateRequest(prompt="hi", request_id=request_id, max_tokens=2)).__aiter__())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id must not contain control characters" in info.value.details()
    assert "found '\\n' at index 1" in info.value.details() and request_id not in info.value.details()


async def test_grpc_refuses_overlong_stop_strings(stub):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await anext(stub.Generate(PB.GenerateRequest(prompt="hi", stop=["x" * 200_000] * 16, max_tokens=2)).__aiter__())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"stop strings must have at most {MAX_STOP_CHARS} characters" in info.value.details()


async def test_the_openapi_document_has_unique_operation_ids(http):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        resp = await http.get("/openapi.json")
    assert resp.status_code == 200
    ids = [op["operationId"] for path in resp.json()["paths"].values() for op in path.values()]
    assert ids and len(ids) == len(set(ids))


async def test_a_client_gone_before_its_body_ends_is_a_400_not_an_exception(core):
    """A client that sends part of a POST body and closes the connection: the router answers 400
    (to nobody) and counts it, instead of raising out of the app (a traceback in the server log)."""
    app = build_app(core)
    messages = [{"type": "http.request", "body": b'{"model": "test-', "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
        "client": ("127.0.0.1", 1), "server": ("router", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 400 and b"closed the connection" in body


async def test_a_kv_cache_smaller_than_the_context_window_says_so(embedded_dir, caplog):
    pool = WorkerPool([], [], ["127.0.0.1:9"])  # never called
    worker = pool.workers[0]
    worker.total_kv_blocks, worker.block_size = 1, 16
    with caplog.at_level("WARNING", logger="pdserve.router.frontend"):
        front = Frontend(embedded_dir, pool, 4096, model_name="test-model")
    assert front.max_model_len == 16
    assert "the smallest worker KV cache holds 16 tokens: the context window is 16 tokens, not" in caplog.text
