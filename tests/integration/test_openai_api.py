"""The OpenAI-compatible HTTP server, driven by the real openai SDK and raw HTTP, on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.chat import ChatTemplate
from pdserve.router.client import Client, make_request
from tests.conftest import mixed_prompts
from tests.integration._pipeline import local_pipeline

PLACEMENTS = ["split", "colocated"]


def sdk(pipe) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pipe.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def grpc_result(pipe, **kw):
    async with Client(pipe.address) as client:
        return await client.generate(make_request(**kw))


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_completions_give_the_grpc_text(model_dir, placement):
    prompts = mixed_prompts()[:3]
    async with local_pipeline(model_dir, placement, http=True) as pipe:
        api = sdk(pipe)
        for prompt in prompts:
            ref = await grpc_result(pipe, prompt=prompt, max_tokens=12, temperature=0)
            full = await api.completions.create(model="test-model", prompt=prompt, max_tokens=12, temperature=0)
            assert full.choices[0].text == ref.text
            assert full.choices[0].finish_reason in ("stop", "length")
            assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (ref.prompt_tokens, len(ref.token_ids))
            assert full.model_extra["pdserve"]["prefill_s"] > 0
            parts, usage, timing = [], None, None
            stream = await api.completions.create(
                model="test-model",
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                    if chunk.choices[0].finish_reason:
                        timing = chunk.model_extra.get("pdserve")
                if chunk.usage:
                    usage = chunk.usage
            assert "".join(parts) == ref.text
            assert usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens == ref.prompt_tokens
            assert timing["total_s"] >= timing["prefill_s"] > 0
            if placement == "split":
                assert timing["kv_transfer_bytes"] > 0
        one = await api.completions.create(model="test-model", prompt=prompts[0], max_tokens=1, temperature=0)
        assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
        ids = Tokenizer.from_folder(model_dir).encode(prompts[1])
        by_ids = await api.completions.create(model="test-model", prompt=ids, max_tokens=8, temperature=0)
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=8, temperature=0)
        assert by_ids.choices[0].text == ref.text
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_chat_renders_the_template_and_gives_the_grpc_text(embedded_dir, placement):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": mixed_prompts()[3]}]
    text = ChatTemplate.from_folder(embedded_dir).render(messages)
    ids = Tokenizer.from_folder(embedded_dir).encode(text, add_special_tokens=False)
    async with local_pipeline(embedded_dir, placement, http=True) as pipe:
        api = sdk(pipe)
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=10, temperature=0)
        full = await api.chat.completions.create(
            model="test-model", messages=messages, max_completion_tokens=10, temperature=0
        )
        assert full.choices[0].message.content == ref.text and full.choices[0].message.role == "assistant"
        assert full.usage.prompt_tokens == len(ids)
        stream = await api.chat.completions.create(
            model="test-model", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == ref.text


async def test_chat_without_a_template_is_a_clear_400(stories_dir):
    async with local_pipeline(stories_dir, "colocated", http=True) as pipe:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            await sdk(pipe).chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])


async def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(embedded_dir):
    async with local_pipeline(embedded_dir, "split", http=True) as pipe:
        api = sdk(pipe)
        long_prompt = "word " * 3000
        cases = [
            (dict(prompt=""), openai.BadRequestError, "empty"),
            (dict(prompt=long_prompt), openai.BadRequestError, "context window"),
            (dict(prompt="hi", temperature=-1), openai.BadRequestError, "temperature"),
            (dict(prompt="hi", top_p=0), openai.BadRequestError, "top_p"),
            (dict(prompt="hi", max_tokens=0), openai.BadRequestError, "max_tokens"),
            (dict(prompt="hi", n=3), openai.BadRequestError, "n must be 1"),
            (dict(prompt=["a", "b"]), openai.BadRequestError, "batched"),
        ]
        for kw, exc, words in cases:
            with pytest.raises(exc, match=words) as info:
                await api.completions.create(model="test-model", **{"max_tokens": 4, **kw})
            assert info.value.status_code == 400 and info.value.body["type"] == "BadRequestError"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await api.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            raw_cases = [  # (body, words in the message or the named param)
                (b"{not json", "not valid JSON"),
                (b"[" * 5000, "not valid JSON"),
                (b'{"prompt": "hi \\ud800", "max_tokens": 2}', "lone UTF-16 surrogate"),
                (
                    b'{"model": "test-model", "messages": [{"role": "user", "content": "\\udfff"}]}',
                    "lone UTF-16 surrogate",
                ),
                (b'{"prompt": "hi", "n": 0}', "n must be 1 (one choice per request), got 0"),
                (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens must be >= 1, got 0"),
                (b'{"prompt": "hi", "max_tokens": -1}', "max_tokens must be >= 1, got -1"),
                (b'{"prompt": "hi", "top_p": 1.5, "max_tokens": 2}', "top_p must be in (0, 1], got 1.5"),
                (b'{"prompt": "hi", "top_p": 1.1, "max_tokens": 2}', "top_p must be in (0, 1], got 1.1"),
                (b'{"prompt": "hi", "temperature": -0.7, "max_tokens": 2}', "got -0.7"),
                (b"[1, 2]", "JSON object"),
                (b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),
                (b'{"prompt": "hi", "max_tokens": true}', "max_tokens"),
                (b'{"prompt": [true, false]}', "prompt"),
                (b'{"prompt": "hi", "stream": "yes"}', "stream"),
                (b'{"prompt": [1099511627776]}', "prompt"),
            ]
            for body, words in raw_cases:
                path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
                r = await http.post(path, content=body, headers={"content-type": "application/json"})
                err = r.json()["error"]
                assert r.status_code == 400, (body[:40], r.text[:200])
                assert words in err["message"] or err["param"] == words, (body[:40], err)
            r = await http.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "ignore_eos": None, "temperature": 0},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            r = await http.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True, "temperature": 0})
            assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions
            r = await http.get("/v1/nowhere")
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
            r = await http.get("/v1/completions")
            assert r.status_code == 405 and r.json()["error"]["type"] == "MethodNotAllowedError"
            assert (await http.head("/health")).status_code == 200
            assert (await http.get("/v1/models/test-model")).json()["id"] == "test-model"
            assert (await http.get("/v1/models/gpt-9")).status_code == 404
            # a 20 MB prompt is refused without being tokenized, and does not hold up the others
            huge = asyncio.create_task(http.post("/v1/completions", json={"prompt": "word " * 4_000_000}, timeout=60))
            t = asyncio.get_running_loop().time()
            small = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert small.status_code == 200 and asyncio.get_running_loop().time() - t < 5.0
            r = await huge
            assert r.status_code == 400 and "at least" in r.json()["error"]["message"]
            too_big = await http.post(
                "/v1/completions", content=b" " * (65 << 20), timeout=60, headers={"content-type": "application/json"}
            )
            assert too_big.status_code == 400 and "bytes" in too_big.json()["error"]["message"]
        ok = await api.completions.create(model="test-model", prompt="hi", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3
        assert await pipe.wait_idle() == 0


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


async def test_metrics_health_and_models(embedded_dir):
    async with local_pipeline(embedded_dir, "split", http=True) as pipe:
        api = sdk(pipe)
        n = 4
        await asyncio.gather(
            *[
                api.completions.create(model="test-model", prompt=p, max_tokens=5, temperature=0)
                for p in mixed_prompts()[:n]
            ]
        )
        with pytest.raises(openai.BadRequestError):
            await api.completions.create(model="test-model", prompt="", max_tokens=5)
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            assert (await http.get("/health")).status_code == 200
            models = (await http.get("/v1/models")).json()
            assert models["data"][0]["id"] == models["data"][0]["root"] == "test-model"
            assert str(embedded_dir) not in json.dumps(models)  # no path for clients
            await asyncio.sleep(0.3)  # one stats poll
            text = (await http.get("/metrics")).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
        assert samples[("pdserve:time_to_first_token_seconds_count", ())] == n
        assert samples[("pdserve:e2e_request_latency_seconds_count", ())] == n
        assert samples[("pdserve:kv_transfer_bytes_count", ())] == n
        assert n <= samples[("pdserve:inter_token_latency_seconds_count", ())] <= n * 4  # 5 tokens, >= 2 messages
        assert samples[("pdserve:requests_total", (("finish_reason", "length"),))] == n
        assert samples[("pdserve:requests_rejected_total", (("reason", "invalid"),))] == 1
        for w in pipe.workers:
            role = "prefill" if w is pipe.workers[0] else "decode"
            key = (("role", role), ("worker", f"{role}-0"))  # role and index, never the address
            assert samples[("pdserve:worker_healthy", key)] == 1
            assert ("pdserve:kv_cache_usage_perc", key) in samples
            assert ("pdserve:num_requests_running", key) in samples
        await pipe.workers[0].stop()  # the prefill worker goes away: not ready any more
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            for _ in range(100):
                r = await http.get("/health")
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.1)
            assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]


async def test_chat_with_a_real_instruct_model(smollm2_dir):
    """SmolLM2-135M-Instruct answers through the openai SDK exactly as gRPC does on the same ids."""
    from tests.conftest import smollm2_chat_ids

    question = "What is the capital of France?"
    ids = smollm2_chat_ids(smollm2_dir, question)
    async with local_pipeline(smollm2_dir, "split", num_kv_blocks=256, http=True) as pipe:
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=16, temperature=0)
        reply = await sdk(pipe).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
        )
        assert reply.choices[0].message.content == ref.text and "Paris" in ref.text
        assert reply.usage.prompt_tokens == len(ids)
