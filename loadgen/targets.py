"""The servers a load test can drive: pdserve's gRPC API, or any OpenAI-compatible HTTP server
(pdserve's own, vLLM, SGLang) through its streaming ``/v1/completions`` endpoint.

Each backend sends one request spec and fills its RequestRecord: token arrival times, finish
reason, error, and the server-side phases when the server reports them. Token counts on the
OpenAI backend come from the response's ``usage``; each SSE event counts as the arrival of one
token (tokens a server delivers in one event share its arrival time, as in vLLM's
``benchmark_serving``), extra events (a final one with no new token) are dropped and missing ones
take the last event's time.

``prefix_counters()`` reads every worker's prefix-cache counters (pdserve's gRPC API with the cluster
secret only), before and after a run, for the per-worker hit rate.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
import httpx

from pdserve.loadgen.metrics import RequestRecord
from pdserve.loadgen.prefix_cache import WorkerPrefixCounters
from pdserve.loadgen.workload import RequestSpec
from pdserve.router.client import FINISH_NAMES, Client, make_request
from pdserve.rpc.auth import cluster_secret, internal_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc

INFO_TIMEOUT_S = 30.0  # GET /v1/models; a streamed completion's bound is its request's own timeout


@dataclass
class ServerInfo:
    """What a load test needs to know of the server: its model (pdserve's id, or a vLLM-style root
    folder; ``cli.tokenizer_folder`` finds the tokenizer from it), context window and placement
    (``"openai"`` when the server does not say)."""

    model: str
    max_model_len: int
    placement: str


class Backend(Protocol):
    name: str

    async def __aenter__(self) -> Backend: ...

    async def __aexit__(self, *exc) -> None: ...

    async def info(self) -> ServerInfo: ...

    async def send(
        self, spec: RequestSpec, rec: RequestRecord, t0: float, timeout_s: float, temperature: float
    ) -> None:
        """Send ``spec`` as exactly ``spec.max_tokens`` tokens (``ignore_eos``, seed = its index)
        and record into ``rec`` (times relative to ``t0``, a ``time.perf_counter`` value)."""
        ...

    async def prefix_counters(self) -> list[WorkerPrefixCounters] | None:
        """Every worker's prefix-cache counters now, or None when the server does not show them."""
        ...


class GrpcBackend:
    """pdserve's ``pdserve.v1.GenerateService`` at ``address`` ("host:port")."""

    name = "grpc"

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.address = address
        self.client = Client(address, api_key)

    async def __aenter__(self) -> GrpcBackend:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.__aexit__(*exc)

    async def info(self) -> ServerInfo:
        info = await self.client.model_info()
        return ServerInfo(info.model, info.max_model_len, info.placement)

    async def prefix_counters(self) -> list[WorkerPrefixCounters] | None:
        """Asked of each worker (WorkerService.GetStats) at the addresses in the router's admin view.
        None when the router shows no addresses (they need the cluster's secret in
        ``$PDSERVE_CLUSTER_SECRET``) or a worker does not answer within 5 s."""

        async def one(w) -> WorkerPrefixCounters:
            async with internal_channel(w.address, None) as channel:  # carries the secret
                s = await worker_pb2_grpc.WorkerServiceStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5.0)
            return WorkerPrefixCounters(w.role, w.address, s.prefix_query_tokens, s.prefix_hit_tokens)

        try:
            workers = (await self.client.model_info(cluster_secret())).workers
            if not workers or not all(w.address for w in workers):
                return None
            return list(await asyncio.gather(*(one(w) for w in workers)))
        except grpc.aio.AioRpcError:
            return None

    async def send(self, spec, rec, t0, timeout_s, temperature) -> None:
        req = make_request(
            "",
            prompt_token_ids=list(spec.prompt_token_ids),
            max_tokens=spec.max_tokens,
            temperature=temperature,
            seed=spec.index,
            ignore_eos=True,
            request_id=rec.request_id,
        )
        try:
            async for msg in self.client.stream(req, timeout=timeout_s):
                now = time.perf_counter() - t0
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    rec.token_times_s += [now] * len(msg.chunk.token_ids)
                elif kind == "complete":
                    c = msg.complete
                    rec.finish_reason = FINISH_NAMES.get(c.finish_reason, "")
                    t = c.timings
                    rec.queue_s, rec.prefill_s = t.queue_ns / 1e9, t.prefill_ns / 1e9
                    rec.kv_transfer_s, rec.decode_s = t.kv_transfer_ns / 1e9, t.decode_ns / 1e9
                    rec.kv_transfer_bytes, rec.prefilled_on_decode = t.kv_transfer_bytes, t.prefilled_on_decode
                    rec.cached_prompt_tokens = t.cached_prompt_tokens
                else:
                    rec.finish_reason, rec.error = "error", f"{msg.error.code}: {msg.error.message}"
        except grpc.aio.AioRpcError as exc:
            rec.finish_reason, rec.error = "error", f"{exc.code().name}: {exc.details()}"


class OpenAIBackend:
    """An OpenAI-compatible server at ``url`` (``http://host:port``), streaming ``/v1/completions``
    with the prompt as token ids and vLLM's ``ignore_eos``."""

    name = "openai"

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None) -> None:
        self.url, self.model = url.rstrip("/"), model
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(None, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def info(self) -> ServerInfo:
        """From ``GET /v1/models``: the first model's id, ``root`` (vLLM: its folder) and ``max_model_len``
        (vLLM and pdserve report both). RuntimeError (one line) when the server cannot be reached,
        gives no answer within ``INFO_TIMEOUT_S`` seconds, answers with no OpenAI model list or
        lists no model."""
        where = f"{self.url}/v1/models"
        try:
            r = await self.http.get("/v1/models", timeout=INFO_TIMEOUT_S)
            r.raise_for_status()
            body = r.json()
        except httpx.TimeoutException:
            raise RuntimeError(f"{where} gave no answer within {INFO_TIMEOUT_S:g} s") from None
        except httpx.HTTPError as exc:  # the first line: httpx adds a second one, a link
            first = (str(exc).splitlines() or ["no detail"])[0]
            raise RuntimeError(f"cannot read {where}: {type(exc).__name__}: {first}") from None
        except ValueError:
            raise RuntimeError(f"{where} answered with no JSON: {r.text[:80]!r}") from None
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in models
        ):
            raise RuntimeError(f"{where} answered with no OpenAI model list (an object whose data lists ids)")
        if not models:
            raise RuntimeError(f"{where} lists no model")
        m = models[0]
        self.model = self.model or m["id"]
        return ServerInfo(m.get("root") or m["id"], int(m.get("max_model_len") or 0), "openai")

    async def prefix_counters(self) -> None:
        """None: the OpenAI API does not report per-worker prefix-cache counters."""
        return None

    async def send(self, spec, rec, t0, timeout_s, temperature) -> None:
        body = {
            "model": self.model,
            "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.max_tokens,
            "temperature": temperature,
            "seed": spec.index,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[float] = []
        usage: dict = {}

        async def stream() -> None:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")[:300]
                    rec.finish_reason, rec.error = "error", f"HTTP {r.status_code}: {detail}"
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec.finish_reason, rec.error = "error", str(event["error"].get("message"))
                        return
                    for choice in event.get("choices") or []:
                        events.append(now)
                        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                    if event.get("pdserve"):
                        t = event["pdserve"]
                        rec.queue_s, rec.prefill_s = t["queue_s"], t["prefill_s"]
                        rec.kv_transfer_s, rec.decode_s = t["kv_transfer_s"], t["decode_s"]
                    usage.update(event.get("usage") or {})

        try:
            await asyncio.wait_for(stream(), timeout_s)
        except asyncio.TimeoutError:
            rec.finish_reason, rec.error = "error", f"no end within {timeout_s:g}s"
        except (httpx.HTTPError, ValueError, KeyError) as exc:  # transport errors, a malformed event
            rec.finish_reason, rec.error = "error", f"{type(exc).__name__}: {exc}"
        n = usage.get("completion_tokens", len(events))
        rec.token_times_s = (events[:n] + events[-1:] * (n - len(events))) if events else []
