"""The OpenAI-compatible HTTP server's event streams, on loopback: no empty chunks, the timings, and a
client that goes away."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.router.client import Client, make_request
from tests.conftest import mixed_prompts
from tests.integration._openai import PLACEMENTS, sdk
from tests.integration._pipeline import local_pipeline


async def sse_events(http: httpx.AsyncClient, body: dict) -> list[dict]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:])
            async for line in r.aiter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


async def test_streams_send_no_chunk_without_text(embedded_dir):
    """Random sampling on a byte-level BPE model splits multi-byte characters across tokens: the
    tokens that end inside a character give gRPC chunks without text, and no SSE event."""
    async with local_pipeline(embedded_dir, "colocated", http=True) as pipe, Client(pipe.address) as client:
        async with httpx.AsyncClient(base_url=pipe.http_url, timeout=60) as http:
            textless = 0
            for seed, prompt in enumerate(["写一个关于猫的故事 🐱", "Emoji: 😀🎉", "混合 mixed text"]):
                body = {"prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": seed, "ignore_eos": True}
                textless += len(
                    [
                        m
                        async for m in client.stream(make_request(**body))
                        if m.WhichOneof("kind") == "chunk" and not m.chunk.text
                    ]
                )
                events = await sse_events(http, {**body, "stream_options": {"include_usage": True}})
                for event in events:
                    assert (
                        event["choices"] == [] or event["choices"][0]["text"] or event["choices"][0]["finish_reason"]
                    ), event
                assert events[-1]["usage"]["completion_tokens"] == 40 and events[-2]["choices"][0]["finish_reason"]
                whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
        assert textless > 0, "no token ended inside a UTF-8 character; the test proves nothing"


async def test_http_timings_say_where_the_prompt_was_prefilled(embedded_dir):
    """The ``pdserve`` timings carry the gRPC Timings' prefilled_on_decode and cached_prompt_tokens."""
    long = [(7 * i) % 997 + 1 for i in range(100)]
    follow_up = long[:96] + list(range(5, 15))  # 6 blocks the decode worker holds, 10 new tokens
    async with (
        local_pipeline(embedded_dir, "split", local_prefill_tokens=32, http=True) as pipe,
        httpx.AsyncClient(base_url=pipe.http_url, timeout=60) as http,
    ):
        body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        first = (await http.post("/v1/completions", json={**body, "prompt": long})).json()["pdserve"]
        assert first["prefilled_on_decode"] is False and first["kv_transfer_bytes"] > 0
        assert first["cached_prompt_tokens"] == 0
        await asyncio.sleep(0.3)  # one stats poll: the router learns that the decode worker caches blocks
        events = await sse_events(http, {**body, "prompt": follow_up})
        again = events[-1]["pdserve"]
        assert again["prefilled_on_decode"] is True and again["kv_transfer_bytes"] == 0
        assert again["cached_prompt_tokens"] == 96


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_a_client_that_drops_the_stream_frees_every_kv_block(embedded_dir, placement):
    async with local_pipeline(embedded_dir, placement, http=True) as pipe:
        body = {
            "model": "test-model",
            "prompt": mixed_prompts()[2],
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        async with (
            httpx.AsyncClient(base_url=pipe.http_url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
        assert await pipe.wait_idle() == 0
        ok = await sdk(pipe).completions.create(model="test-model", prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2
