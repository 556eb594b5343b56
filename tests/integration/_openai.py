"""The openai SDK pointed at a local pipeline's HTTP API, and the gRPC answer to compare it with."""

from __future__ import annotations

import openai

from pdserve.router.client import Client, make_request

PLACEMENTS = ["split", "colocated"]


def sdk(pipe) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pipe.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def grpc_result(pipe, **kw):
    async with Client(pipe.address) as client:
        return await client.generate(make_request(**kw))
