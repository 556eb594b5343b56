"""``bench --backend openai`` reads the server's ``/v1/models`` first: an answer that is no model
list, an error status or no answer at all end in one RuntimeError line naming the URL, never a
traceback or a wait without end."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.loadgen import targets
from pdserve.loadgen.targets import OpenAIBackend


def backend(answer) -> OpenAIBackend:
    b = OpenAIBackend("http://127.0.0.1:9")
    b.http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(answer))
    return b


@pytest.mark.parametrize(
    "response, needle",
    [
        (httpx.Response(200, json=[{"id": "m"}]), "no OpenAI model list"),
        (httpx.Response(200, json={"data": [{"root": "/models/m"}]}), "no OpenAI model list"),
        (httpx.Response(200, json={"data": "m"}), "no OpenAI model list"),
        (httpx.Response(200, json={"data": []}), "lists no model"),
        (httpx.Response(200, text="<html>hello</html>"), "answered with no JSON: '<html>hello</html>'"),
        (httpx.Response(404, text="not here"), "cannot read http://127.0.0.1:9/v1/models: HTTPStatusError"),
    ],
)
async def test_a_bad_model_list_is_one_clear_line(response, needle):
    async with backend(lambda request: response) as b:
        with pytest.raises(RuntimeError) as exc:
            await b.info()
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith("http://127.0.0.1:9/v1/models") or "cannot read" in str(exc.value)


async def test_a_transport_error_without_a_message_is_still_one_line():
    def refuse(request):
        raise httpx.ConnectError("")

    async with backend(refuse) as b:
        with pytest.raises(RuntimeError, match=r"^cannot read http://127.0.0.1:9/v1/models: ConnectError: no detail$"):
            await b.info()


async def test_a_good_model_list_names_the_model():
    answer = httpx.Response(200, json={"data": [{"id": "m", "root": "/models/m", "max_model_len": 512}]})
    async with backend(lambda request: answer) as b:
        info = await b.info()
        assert (info.model, info.max_model_len, b.model) == ("/models/m", 512, "m")


async def test_a_server_that_never_answers_is_given_up_on(monkeypatch):
    """A listener on loopback that accepts the connection and says nothing."""
    monkeypatch.setattr(targets, "INFO_TIMEOUT_S", 0.5)
    held = []

    async def silent(reader, writer):
        held.append(writer)
        await reader.read()  # until the client goes

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with OpenAIBackend(f"http://127.0.0.1:{port}") as b:
            with pytest.raises(RuntimeError, match=r"gave no answer within 0.5 s"):
                await asyncio.wait_for(b.info(), 10)
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
