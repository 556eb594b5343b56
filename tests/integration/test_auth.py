"""API keys on the client-facing APIs; the cluster secret on every internal call and for the admin model info."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.client import Client, make_request
from pdserve.rpc.auth import SECRET_ENV
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.integration._pipeline import local_pipeline


async def test_api_keys_guard_both_apis_and_abort_is_per_key(embedded_dir, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    async with local_pipeline(embedded_dir, "split", http=True, api_keys=("key-a", "key-b")) as pipe:
        for key in (None, "wrong"):
            async with Client(pipe.address, key) as client:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.generate(make_request("hi", max_tokens=2))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in info.value.details()
                assert "key-a" not in info.value.details()
        async with grpc.aio.insecure_channel(pipe.address) as ch:  # health stays open
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with Client(pipe.address, "key-a") as a, Client(pipe.address, "key-b") as b:
            assert len((await a.generate(make_request("hi", max_tokens=3, temperature=0))).token_ids) == 3
            long = asyncio.create_task(
                a.generate(make_request("hi", max_tokens=500, ignore_eos=True, request_id="mine"))
            )
            await asyncio.sleep(0.3)
            assert await b.abort("mine") is False  # another key's request: no effect
            assert await a.abort("mine") is True
            assert (await long).finish_reason == "abort"
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=pipe.http_url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model="test-model", prompt="hi", max_tokens=2
            )
        ok = await openai.AsyncOpenAI(
            base_url=pipe.http_url + "/v1", api_key="key-b", max_retries=0
        ).completions.create(model="test-model", prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            refused = await http.get("/v1/models")
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert (await http.get("/health")).status_code == 200  # probes need no key
            for headers in ({}, {"authorization": "Bearer wrong"}):  # nor does anything else
                scrape = await http.get("/metrics", headers=headers)
                assert scrape.status_code == 401 and scrape.headers["www-authenticate"] == "Bearer"
                assert scrape.json() == refused.json() and "pdserve:" not in scrape.text
            metrics = await http.get("/metrics", headers={"authorization": "Bearer key-b"})  # as Prometheus scrapes
        assert metrics.status_code == 200
        families = list(text_string_to_metric_families(metrics.text))
        rejected = {
            s.labels["reason"]: s.value for f in families if f.name == "pdserve:requests_rejected" for s in f.samples
        }
        assert rejected["unauthenticated"] == 6  # two gRPC calls, four HTTP 401s
        assert rejected["invalid"] == 0
        # workers by role and index: no internal address or port
        healthy = {
            s.labels["worker"]: s.value for f in families if f.name == "pdserve:worker_healthy" for s in f.samples
        }
        assert healthy == {"prefill-0": 1, "decode-0": 1}
        ports = [w.address.rpartition(":")[2] for w in pipe.workers]
        values = [v for f in families for s in f.samples for v in s.labels.values()]
        assert "127.0.0.1" not in metrics.text and not [v for v in values for p in ports if p in v]
        assert await pipe.wait_idle() == 0


async def test_internal_calls_need_the_cluster_secret(embedded_dir, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "cluster-secret-for-this-test")
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        res = await client.generate(make_request("Once upon a time", max_tokens=5, temperature=0))
        assert len(res.token_ids) == 5 and not res.error  # router -> workers and prefill -> decode carry it
        for w in pipe.workers:
            async with grpc.aio.insecure_channel(w.address) as ch:  # a stranger: no secret
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(pipe.workers[1].address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.DecodeServiceStub(ch).PushKv(iter([worker_pb2.KvChunk(data=b"x" * 64)]))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await pipe.wait_idle() == 0


async def test_model_info_shows_the_model_path_and_worker_addresses_only_to_an_admin(embedded_dir, monkeypatch):
    secret = "cluster-secret-for-this-test"
    monkeypatch.setenv(SECRET_ENV, secret)
    async with local_pipeline(embedded_dir, "split", http=True) as pipe, Client(pipe.address) as client:
        addresses = sorted(w.address for w in pipe.workers)
        for view in (await client.model_info(), await client.model_info(cluster_secret="a-guess")):
            assert view.model == "test-model" and view.model_path == "" and view.max_model_len > 0
            assert sorted((w.role, w.healthy, w.address) for w in view.workers) == [
                ("decode", True, ""),
                ("prefill", True, ""),
            ]
            assert str(embedded_dir) not in str(view) and not any(a in str(view) for a in addresses)
        admin = await client.model_info(cluster_secret=secret)
        assert admin.model == "test-model" and admin.model_path == str(embedded_dir)
        assert sorted(w.address for w in admin.workers) == addresses
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            models = (await http.get("/v1/models")).text
        assert str(embedded_dir) not in models and "test-model" in models
    monkeypatch.delenv(SECRET_ENV)  # a router without a cluster secret has no admin view
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        await pipe.workers[1].stop()  # the decode worker: its health shows, its address does not
        for _ in range(100):
            info = await client.model_info(cluster_secret=secret)
            if not all(w.healthy for w in info.workers):
                break
            await asyncio.sleep(0.05)
        assert info.model_path == ""
        assert sorted((w.role, w.healthy, w.address) for w in info.workers) == [
            ("decode", False, ""),
            ("prefill", True, ""),
        ]


def test_api_key_settings_that_would_leave_the_server_open_are_refused():
    from pdserve.rpc.auth import parse_api_keys

    assert parse_api_keys(None) == () and parse_api_keys(" a , b ") == ("a", "b")
    for value in ("", ",", " , "):
        with pytest.raises(ValueError, match="holds no key"):
            parse_api_keys(value)
    with pytest.raises(ValueError, match="printable ASCII"):
        parse_api_keys("ключ")


@pytest.fixture
def self_signed(tmp_path):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


async def test_tls_on_both_client_facing_apis(embedded_dir, self_signed):
    cert, key = self_signed
    async with local_pipeline(embedded_dir, "split", http=True, tls=(cert, key)) as pipe:
        async with Client(pipe.address, tls_ca=cert) as client:
            res = await client.generate(make_request("hi", max_tokens=3, temperature=0))
            assert len(res.token_ids) == 3 and not res.error
        async with Client(pipe.address) as plain:  # plaintext against a TLS port: no service
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await plain.generate(make_request("hi", max_tokens=3), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        url = f"https://{pipe.router.http_address}"
        import ssl

        async with httpx.AsyncClient(base_url=url, verify=ssl.create_default_context(cafile=cert)) as https:
            r = await https.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            with pytest.raises(httpx.HTTPError):
                await http.get("/health")
