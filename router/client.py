"""A small asyncio gRPC client for GenerateService (used by ``pdserve generate``, the demo and tests)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.router.timings import RequestTiming
from pdserve.rpc.auth import API_KEY_ENV, SECRET_HEADER, client_channel
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.v1 import generate_pb2 as PB
from pdserve.v1 import generate_pb2_grpc

FINISH_NAMES = {
    PB.FINISH_REASON_STOP: "stop",
    PB.FINISH_REASON_LENGTH: "length",
    PB.FINISH_REASON_ABORT: "abort",
    PB.FINISH_REASON_ERROR: "error",
}


@dataclass
class GenerationResult(RequestTiming):
    """One finished stream as the client saw it. ``sent_s`` and ``token_times_s`` are
    ``time.perf_counter`` readings (seconds); TTFT, TPOT, ITL and E2E latency (``ttft_s``,
    ``tpot_s``, ``itl_s``, ``e2e_s``, seconds) are :class:`~pdserve.router.timings.RequestTiming`'s,
    the definitions the load generator uses too."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    timings: PB.Timings | None = None
    request_id: str = ""

    # Deprecated aliases (CHANGELOG.md), the same values in seconds under the names of 0.1.0.
    sent_at = property(lambda self: self.sent_s)
    token_times = property(lambda self: self.token_times_s)
    ttft = property(lambda self: self.ttft_s)
    tpot = property(lambda self: self.tpot_s)


def make_request(
    prompt: str,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
    prompt_token_ids: list[int] | None = None,
) -> PB.GenerateRequest:
    """A GenerateRequest; unset values take the server defaults."""
    sampling = PB.SamplingParams()
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = PB.GenerateRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=sampling,
        stop=stop or [],
        ignore_eos=ignore_eos,
        prompt_token_ids=prompt_token_ids or [],
    )
    if max_tokens is not None:
        req.max_tokens = max_tokens
    return req


class Client:
    """Async client over one channel to the router at ``address`` ("host:port")."""

    def __init__(self, address: str, api_key: str | None = None, tls_ca: str | None = None) -> None:
        """``api_key``: sent as ``authorization: Bearer`` on every call (default $PDSERVE_API_KEY).
        ``tls_ca``: a PEM file to trust; the router is then reached over TLS."""
        ca = Path(tls_ca).read_bytes() if tls_ca else None
        self.channel = client_channel(address, GRPC_OPTIONS, api_key or os.environ.get(API_KEY_ENV) or None, ca)
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def stream(
        self, request: PB.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[PB.GenerateResponse]:
        """Raw response stream; raises grpc.aio.AioRpcError for a refused request."""
        async for msg in self.stub.Generate(request, timeout=timeout):
            yield msg

    async def generate(
        self, request: PB.GenerateRequest, timeout: float | None = None, on_text=None
    ) -> GenerationResult:
        """Run a request to its end; ``on_text(str)`` is called with every text delta.

        Raises grpc.aio.AioRpcError when the server refuses the request (e.g. INVALID_ARGUMENT).
        """
        res = GenerationResult(sent_s=time.perf_counter())
        async for msg in self.stream(request, timeout):
            now = time.perf_counter()
            kind = msg.WhichOneof("kind")
            text = ""
            if kind == "chunk":
                res.token_ids += msg.chunk.token_ids
                res.token_times_s += [now] * len(msg.chunk.token_ids)
                res.prompt_tokens = msg.chunk.usage.prompt_tokens
                text = msg.chunk.text
            elif kind == "complete":
                res.finish_reason = FINISH_NAMES.get(msg.complete.finish_reason, "")
                res.timings = msg.complete.timings
                res.request_id = msg.complete.request_id
                res.prompt_tokens = msg.complete.usage.prompt_tokens
                text = msg.complete.text
            else:
                res.finish_reason, res.error = "error", f"{msg.error.code}: {msg.error.message}"
            res.text += text
            if text and on_text is not None:
                on_text(text)
        return res

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(PB.AbortRequest(request_id=request_id))).aborted

    async def model_info(self, cluster_secret: str | None = None) -> PB.ModelInfo:
        """What the router serves. With the cluster's secret (``Cluster.secret``, or the
        ``$PDSERVE_CLUSTER_SECRET`` the cluster was started with), the admin view: the model
        folder and the worker addresses too; a wrong secret gets the plain view."""
        metadata = ((SECRET_HEADER, cluster_secret),) if cluster_secret else None
        return await self.stub.GetModelInfo(PB.GetModelInfoRequest(), metadata=metadata)
