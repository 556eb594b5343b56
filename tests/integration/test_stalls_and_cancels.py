"""The router's stall watchdog and its count of client cancels, on a real split pipeline."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import pytest

import pdserve.router.frontend as router_core
from pdserve.router.client import Client, make_request
from pdserve.router.validation import validate
from tests.integration._pipeline import local_pipeline


def sample(core, name: str, labels: dict | None = None) -> float:
    for metric in core.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    raise KeyError(name)


async def test_a_stream_without_tokens_past_the_bound_is_logged_counted_and_recovers(embedded_dir, caplog):
    """The decode worker's steps freeze for 1.5 s mid-stream: the router logs the stream, counts one
    stall, shows it in the stalled gauge while it lasts, and logs the first token after it."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        core = pipe.router.core
        core.stall_warn_s = 0.5
        engine = pipe.workers[1].worker.engine
        step = engine.step
        frozen = {"done": False}

        def slow_step():
            if not frozen["done"] and any(s.num_output_tokens >= 5 for s in engine.scheduler.running):
                frozen["done"] = True
                time.sleep(1.5)
            return step()

        engine.step = slow_step
        caplog.set_level(logging.WARNING, logger="pdserve.router.frontend")
        task = asyncio.create_task(
            client.generate(make_request("tell me", max_tokens=40, ignore_eos=True, request_id="slow-one"))
        )
        seen_gauge = 0.0
        while not task.done():
            seen_gauge = max(seen_gauge, sample(core, "pdserve:streams_stalled"))
            await asyncio.sleep(0.05)
        res = task.result()
        assert len(res.token_ids) == 40
        assert sample(core, "pdserve:stream_stalls_total") == 1
        assert seen_gauge == 1 and sample(core, "pdserve:streams_stalled") == 0
        text = caplog.text
        assert "request slow-one: no token for" in text and "request slow-one: a token again after" in text
        assert max(b - a for a, b in zip(res.token_times_s, res.token_times_s[1:])) > 1.0


async def test_every_client_cancel_is_counted_as_an_abort(embedded_dir, monkeypatch):
    """Clients cancel 12 streams the router has received: while their prompt is tokenized, before
    the first token, right after it, and mid-stream. The router's
    requests_total{finish_reason="abort"} rises by exactly 12 (a cancel that reaches the server
    before the request does is a request it never saw)."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        core = pipe.router.core
        before = sample(core, "pdserve:requests_total", {"finish_reason": "abort"})
        validating = threading.Event()

        def slow_validate(request, *args):
            if request.prompt == "slow to tokenize":
                validating.set()
                time.sleep(1.0)
            return validate(request, *args)

        monkeypatch.setattr(router_core, "validate", slow_validate)

        async def cancel_after(i: int, tokens: int) -> None:
            rid = f"cancelled-{i}"
            call = client.stub.Generate(
                make_request("a long story " * 20, max_tokens=400, ignore_eos=True, request_id=rid)
            )
            seen = 0
            if tokens < 0:  # while the router validates and tokenizes it, before it is in flight
                call = client.stub.Generate(make_request("slow to tokenize", max_tokens=4))
                while not validating.is_set():
                    await asyncio.sleep(0.001)
                call.cancel()
                return
            if tokens == 0:
                while rid not in core.inflight:
                    await asyncio.sleep(0.001)
                call.cancel()
                return
            async for msg in call:
                seen += len(msg.chunk.token_ids)
                if seen >= tokens:
                    call.cancel()
                    return

        await asyncio.gather(
            *(cancel_after(i, n) for i, n in enumerate((-1, 0, 0, 0, 1, 1, 1, 1, 20, 20, 20, 20))),
            return_exceptions=True,
        )
        deadline = time.monotonic() + 10
        while sample(core, "pdserve:requests_total", {"finish_reason": "abort"}) < before + 12:
            assert time.monotonic() < deadline, sample(core, "pdserve:requests_total", {"finish_reason": "abort"})
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert sample(core, "pdserve:requests_total", {"finish_reason": "abort"}) == before + 12
        assert await pipe.wait_idle() == 0
        ok = await client.generate(make_request("hi", max_tokens=2))
        assert len(ok.token_ids) == 2


async def test_a_failed_worker_call_names_no_internal_address(embedded_dir, caplog):
    """With the decode worker gone, gRPC's error text names the address it failed to reach; the
    client's error says "a worker" instead, and only the router's log keeps the address."""
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        decode = pipe.workers[1]
        port = decode.address.rsplit(":", 1)[1]
        await decode.stop()
        caplog.set_level(logging.WARNING, logger="pdserve.router.frontend")
        pipe.router.core.pool.workers[1].healthy = True  # as if its death were not noticed yet
        try:
            res = await client.generate(make_request("hello", max_tokens=4), timeout=30)
            message = res.error
        except grpc.aio.AioRpcError as exc:
            message = exc.details()
        assert message and "127.0.0.1" not in message and port not in message, message
        assert port in caplog.text


@pytest.mark.parametrize("streaming", [True, False])
async def test_an_http_client_gone_before_its_first_token_cancels_the_request(embedded_dir, streaming):
    """The prefill worker is frozen for 3 s; a client that closes its connection 0.3 s after
    sending is an abort at once (not when its first token would have come), and no worker keeps
    the request."""
    import httpx

    async with local_pipeline(embedded_dir, "split", http=True) as pipe:
        core = pipe.router.core
        engine = pipe.workers[0].worker.engine
        step, frozen = engine.step, {"done": False}

        def slow_step():
            if not frozen["done"] and engine.scheduler.waiting:
                frozen["done"] = True
                time.sleep(3.0)
            return step()

        engine.step = slow_step
        before = sample(core, "pdserve:requests_total", {"finish_reason": "abort"})
        body = {"prompt": "a long story", "max_tokens": 50, "stream": streaming}
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=pipe.http_url) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.3))
        while sample(core, "pdserve:requests_total", {"finish_reason": "abort"}) < before + 1:
            assert time.monotonic() - t0 < 2.5, "the abort waited for the first token"
            await asyncio.sleep(0.05)
        assert not core.inflight
        assert await pipe.wait_idle() == 0
