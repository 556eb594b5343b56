"""The soak's overload phase: twice a split cluster's measured capacity for a minute.

A fresh cluster of 2 prefill + 2 decode workers (a local Ray instance, loopback only) first
measures its capacity: after a warm-up burst, a burst of ``CALIBRATION_REQUESTS`` requests
sent at once, in requests per second until the last one completes. Then requests arrive as a Poisson process at
``factor`` times that rate for ``seconds`` seconds, greedy and float32 with random token-id
prompts of trace-like lengths, none cancelled. With ``max_requests_per_worker`` each decode
worker holds a bounded number of requests, so the router must refuse the rest at once
(RESOURCE_EXHAUSTED) rather than queue them without end. Every request must end, completed or
refused; none may hang, no KV block may stay used, and the completed ones' greedy tokens must
equal an undisturbed run's.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter

from pdserve.router.client import Client

CALIBRATION_REQUESTS = 32  # sent at once, after as many again to warm the workers up


async def _burst(address: str, requests) -> float:
    """Send ``requests`` at once; those completed over the seconds until the last one ended."""
    from pdserve.soak.soak_requests import send_request

    for r in requests:
        r.send_at_s = 0.0
    t0 = time.monotonic()
    async with Client(address) as client:
        await asyncio.gather(*(send_request(client, r, t0) for r in requests))
    return sum(r.outcome == "completed" for r in requests) / (time.monotonic() - t0)


async def _offered(address: str, requests) -> None:
    from pdserve.soak.soak_requests import send_request

    t0 = time.monotonic()
    async with Client(address) as client:
        await asyncio.gather(*(send_request(client, r, t0) for r in requests))


def run_overload(
    model: str = "embedded",
    seconds: float = 60.0,
    factor: float = 2.0,
    num_prefill: int = 2,
    num_decode: int = 2,
    max_requests_per_worker: int = 16,
    length_scale: float = 0.1,
    seed: int = 0,
) -> dict:
    """Run the phase and return its figures (``overload_lines`` formats them). ``seconds``: how
    long requests arrive; ``factor``: the offered rate over the measured capacity."""
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.soak.checks import greedy_mismatches, settled_blocks
    from pdserve.soak.soak_requests import build_requests

    model_dir = resolve_model_dir(model)
    mc = ModelConfig.from_folder(model_dir)
    max_len = min(mc.max_position_embeddings, 1024)
    engine_cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=max_len, kv_cache_gib=0.5)
    cfg = ClusterConfig(
        engine=engine_cfg,
        placement="split",
        router_port=0,
        http_port=0,
        num_prefill=num_prefill,
        num_decode=num_decode,
        max_requests_per_worker=max_requests_per_worker,
    )
    burst = min(CALIBRATION_REQUESTS, num_decode * max_requests_per_worker or CALIBRATION_REQUESTS)
    warm_up, calibration = (
        build_requests(burst, 1.0, mc.vocab_size, max_len, seed + k, 0.0, 0.0, length_scale) for k in (1, 2)
    )
    with start_cluster(cfg) as cluster:
        asyncio.run(_burst(cluster.address, warm_up))
        capacity = asyncio.run(_burst(cluster.address, calibration))
        rate = factor * capacity
        requests = build_requests(
            max(1, math.ceil(rate * seconds)), rate, mc.vocab_size, max_len, seed, 0.0, 0.0, length_scale
        )
        t = time.monotonic()
        asyncio.run(_offered(cluster.address, requests))
        elapsed = time.monotonic() - t
        used = asyncio.run(settled_blocks(cluster))
    done = [r for r in requests if r.outcome == "completed"]
    refused = [r for r in requests if r.outcome == "RESOURCE_EXHAUSTED"]
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "seconds": seconds,
        "requests": len(requests),
        "elapsed_s": elapsed,
        "outcomes": Counter(r.outcome for r in requests),
        "hung": sum(r.outcome in ("hung", "") for r in requests),
        "used_blocks": used,
        "mismatches": greedy_mismatches(engine_cfg, done),
        "ttft_p50_s": statistics.median(r.ttft_s for r in done) if done else float("nan"),
        "ttft_max_s": max((r.ttft_s for r in done), default=float("nan")),
        "e2e_max_s": max((r.ended_s for r in done), default=float("nan")),
        "refusal_max_s": max((r.ended_s for r in refused), default=float("nan")),
        "workers": f"{num_prefill} + {num_decode}",
        "max_requests_per_worker": max_requests_per_worker,
    }


def overload_lines(s: dict) -> list[str]:
    o = s["outcomes"]
    other = {k: v for k, v in o.items() if k not in ("completed", "RESOURCE_EXHAUSTED", "hung", "")}
    return [
        f"overload: {s['workers']} workers, capacity {s['capacity_rps']:.2f} req/s measured; "
        f"{s['requests']} requests at {s['rate_rps']:.2f} req/s for {s['seconds']:.0f}s "
        f"(--max-requests-per-worker {s['max_requests_per_worker']}), all ended in {s['elapsed_s']:.0f}s",
        "| completed | refused (RESOURCE_EXHAUSTED) | failed otherwise | hung | leaked KV blocks | greedy "
        "mismatches | TTFT p50 s | TTFT max s | e2e max s | slowest refusal s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {o.get('completed', 0)} | {o.get('RESOURCE_EXHAUSTED', 0)} | {sum(other.values())} {other or ''} | "
        f"{s['hung']} | {sum(s['used_blocks'].values())} | {s['mismatches']} | {s['ttft_p50_s']:.2f} | "
        f"{s['ttft_max_s']:.2f} | {s['e2e_max_s']:.2f} | {s['refusal_max_s']:.3f} |",
    ]


def overload_ok(s: dict) -> bool:
    """Every request ended, completed or refused; nothing hung or leaked; no wrong token."""
    return (
        s["hung"] == 0
        and not any(s["used_blocks"].values())
        and s["mismatches"] == 0
        and set(s["outcomes"]) <= {"completed", "RESOURCE_EXHAUSTED"}
    )
