"""The OpenAI-compatible HTTP server's completions, driven by the real openai SDK and raw HTTP, on loopback:
the gRPC text, and OpenAI errors for bad requests."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from tests.conftest import mixed_prompts
from tests.integration._openai import PLACEMENTS, grpc_result, sdk
from tests.integration._pipeline import local_pipeline


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
