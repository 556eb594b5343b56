"""The requests of the soak runs (``pdserve soak`` and its overload phase) and how each is sent.

:func:`build_requests` makes the requests of a run: the Azure conversation trace's arrival times and
lengths (a Poisson process with trace-like lengths when the datasets folder is absent), random
token-id prompts, and what the client does with each (completes it, cancels it after a random
delay, or gives it a deadline too tight to finish). :func:`send_request` sends one at its time and
records in its :class:`SoakRequest` how it ended, "hung" when it outlived its deadline by
``HANG_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.router.client import Client, make_request

HANG_GRACE_S = 60.0  # after its deadline (or the run's end) a request still open counts as hung


@dataclass
class SoakRequest:
    index: int
    send_at_s: float
    prompt: list[int]
    max_tokens: int
    action: str  # "normal", "cancel" or "deadline"
    cancel_after_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    outcome: str = ""  # "completed", "cancelled", "DEADLINE_EXCEEDED", an error status, or "hung"
    ttft_s: float = float("nan")  # sent to first token
    ended_s: float = float("nan")  # sent to its last message or error


def build_requests(
    n: int,
    rate: float,
    vocab: int,
    max_model_len: int,
    seed: int,
    cancel_frac: float,
    deadline_frac: float,
    length_scale: float,
) -> list[SoakRequest]:
    from pdserve.loadgen.workload import clip_lengths, load_trace, poisson_arrivals, scale_to_rate, window

    rng = random.Random(seed)
    try:
        rows = scale_to_rate(window(load_trace("azure-conv"), 0.0, None, n), rate)
        arrivals, lengths = [r.t_s for r in rows], [(r.input_tokens, r.output_tokens) for r in rows]
    except FileNotFoundError:  # no datasets folder: Poisson arrivals, lengths like the trace's
        print(
            f"soak: no Azure trace found (datasets folder); Poisson arrivals at {rate:g} req/s with "
            f"trace-like lengths instead",
            flush=True,
        )
        arrivals = poisson_arrivals(rate, n, seed)
        lengths = [(int(rng.lognormvariate(6.5, 1.0)), int(rng.lognormvariate(5.3, 0.8))) for _ in range(n)]
    out = []
    for i, (t, (inp, outp)) in enumerate(zip(arrivals, lengths)):
        inp, outp = clip_lengths(inp, outp, max_model_len, length_scale, max_model_len // 2, 256)
        u = rng.random()
        action = "cancel" if u < cancel_frac else "deadline" if u < cancel_frac + deadline_frac else "normal"
        out.append(
            SoakRequest(
                i,
                t,
                [rng.randrange(3, vocab) for _ in range(inp)],
                outp,
                action,
                cancel_after_s=rng.uniform(0.002, 0.1),
            )
        )
    return out


async def send_request(client: Client, r: SoakRequest, t0: float) -> None:
    """Send ``r`` at ``t0 + r.send_at_s`` (monotonic seconds), do what its ``action`` says, and
    record its tokens, time to first token, end time and outcome in ``r``."""
    await asyncio.sleep(max(0.0, t0 + r.send_at_s - time.monotonic()))
    req = make_request("", prompt_token_ids=r.prompt, max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
    timeout = 0.01 if r.action == "deadline" else 120.0
    call = client.stub.Generate(req, timeout=timeout)
    if r.action == "cancel":
        asyncio.get_running_loop().call_later(r.cancel_after_s, call.cancel)

    sent = time.monotonic()

    async def consume() -> None:
        async for msg in call:
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                if not r.tokens and msg.chunk.token_ids:
                    r.ttft_s = time.monotonic() - sent
                r.tokens += msg.chunk.token_ids
            elif kind == "complete":
                r.outcome = "completed"
            else:
                r.outcome = msg.error.code

    try:
        await asyncio.wait_for(consume(), timeout + HANG_GRACE_S)
    except asyncio.CancelledError:
        if not (r.action == "cancel" and call.cancelled()):  # grpc.aio raises this for our own cancel
            raise
        r.outcome = "cancelled"
    except asyncio.TimeoutError:
        r.outcome = "hung"
        call.cancel()
    except grpc.aio.AioRpcError as exc:
        r.outcome = "cancelled" if exc.code() == grpc.StatusCode.CANCELLED else exc.code().name
    finally:
        r.ended_s = time.monotonic() - sent
