"""A client for test_two_nodes.py, run inside one of its network namespaces (``ip netns exec``).

    python _two_nodes_client.py ROUTER --prompts JSON_LIST [--max-tokens N] [--call-timeout S]
                                [--until-ok S] [--stats ADDR ...]

Sends each prompt greedily (one request each, all at once); with ``--until-ok S`` it retries the
whole set until every request succeeds, for at most S seconds. For each ``--stats`` worker address
it calls WorkerService.GetStats twice: without metadata, and with ``$PDSERVE_CLUSTER_SECRET`` as
``x-pdserve-cluster-secret``. Prints one JSON object: ``tokens`` (a list per prompt), ``attempts``,
``ok_at`` (``time.time()`` when the last attempt ended), ``errors`` (each distinct failure) and
``stats`` ({address: [status without, status with]}). Seconds throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import grpc

from pdserve.router.client import Client, make_request
from pdserve.v1 import worker_pb2, worker_pb2_grpc

STATS_TIMEOUT_S = 10.0


async def _generate_all(
    router: str, prompts: list[str], max_tokens: int, timeout_s: float
) -> tuple[list[list[int]] | None, str]:
    """Token ids per prompt, or None and the first failure when any request failed."""
    async with Client(router) as client:
        try:
            results = await asyncio.gather(
                *[
                    client.generate(make_request(p, max_tokens=max_tokens, temperature=0), timeout=timeout_s)
                    for p in prompts
                ]
            )
        except grpc.aio.AioRpcError as exc:
            return None, f"{exc.code().name}: {exc.details()}"
    errors = [r.error for r in results if r.error]
    return (None, errors[0]) if errors else ([list(r.token_ids) for r in results], "")


async def _stats_status(address: str, secret: str | None) -> str:
    """The status name of one GetStats call ("OK" when it answered)."""
    metadata = (("x-pdserve-cluster-secret", secret),) if secret else None
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(
                worker_pb2.GetStatsRequest(), metadata=metadata, timeout=STATS_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "OK"


async def main(args) -> dict:
    t0 = time.monotonic()
    tokens, attempts, errors = None, 0, []
    while tokens is None:
        attempts += 1
        tokens, error = await _generate_all(args.router, json.loads(args.prompts), args.max_tokens, args.call_timeout)
        errors += [error] if error and error not in errors else []
        if tokens is None and time.monotonic() - t0 > args.until_ok:
            break
        if tokens is None:
            await asyncio.sleep(0.25)
    ok_at = time.time()
    secret = os.environ.get("PDSERVE_CLUSTER_SECRET")
    stats = {a: [await _stats_status(a, None), await _stats_status(a, secret)] for a in args.stats}
    return {"tokens": tokens, "attempts": attempts, "ok_at": ok_at, "errors": errors, "stats": stats}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("router")
    p.add_argument("--prompts", required=True, help="JSON list of strings")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--call-timeout", type=float, default=10.0, help="seconds per request")
    p.add_argument("--until-ok", type=float, default=0.0, help="seconds to keep retrying")
    p.add_argument("--stats", nargs="*", default=[])
    print(json.dumps(asyncio.run(main(p.parse_args()))))
