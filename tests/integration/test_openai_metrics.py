"""The OpenAI-compatible HTTP server's /metrics, /health and /v1/models, on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import mixed_prompts
from tests.integration._openai import sdk
from tests.integration._pipeline import local_pipeline


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
