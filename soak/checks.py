"""What the soak checks once its requests ended: KV blocks still used on each worker, greedy
tokens against an undisturbed run, and the router's migration count."""

from __future__ import annotations

import asyncio
import time

import grpc


async def used_blocks(cluster) -> dict[str, int]:
    """Per worker ("role@address"): KV blocks used plus sequences running or waiting."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    used = {}
    for address, role in cluster.workers.items():
        async with grpc.aio.insecure_channel(address) as ch:
            s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(
                worker_pb2.GetStatsRequest(), metadata=(("x-pdserve-cluster-secret", cluster.secret),), timeout=10
            )
            used[f"{role}@{address}"] = s.used_kv_blocks + s.num_running + s.num_waiting
    return used


def greedy_mismatches(engine_cfg, done: list) -> int:
    """How many completed requests' tokens differ from the same prompts run undisturbed on one
    local engine (greedy, so each has one right answer)."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    engine, mismatches = LLMEngine(engine_cfg), 0
    for n in sorted({r.max_tokens for r in done}):
        same = [r for r in done if r.max_tokens == n]
        ref = engine.generate([r.prompt for r in same], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        mismatches += sum(r.tokens != t for r, t in zip(same, ref))
    return mismatches


async def settled_blocks(cluster, limit_s: float = 15.0) -> dict[str, int]:
    """``used_blocks`` once they reach 0 everywhere, or after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        used = await used_blocks(cluster)
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.2)


def scrape_migrations(http_address: str) -> int:
    """``pdserve:request_migrations_total`` from the router's /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("pdserve:request_migrations_total "):
                return int(float(line.split()[1]))
    return 0
