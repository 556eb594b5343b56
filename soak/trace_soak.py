"""``pdserve soak``: a split cluster on a local Ray instance under a real trace, with client cancels,
tight deadlines and worker kills, checked for hangs, leaked KV blocks and wrong tokens.

Requests (:mod:`pdserve.soak.soak_requests`): the Azure conversation trace's arrival times and
lengths (``--length-scale``; a Poisson process with trace-like lengths when the datasets folder is
absent), rescaled to ``--rate``, with random token-id prompts, greedy and float32 so that every
output has one right answer. A share of them (``--cancel-frac``) is cancelled by its client after a
random delay, another (``--deadline-frac``) gets a deadline too tight to finish. Mid-run, the decode
worker and then the prefill worker are killed (SIGKILL of the actor's process); Ray restarts them
and the cluster's supervisor brings them back. Each request must end on its own: completed, or with
a status.

At the end it prints requests completed / migrated / failed by status / cancelled / past their
deadline, hung requests (none may be), used KV blocks per worker (must be 0), greedy mismatches
of completed requests against the same prompts run undisturbed on a local engine (must be 0), and
the time to recover after each kill. Loopback only; every wait is bounded.

``--two-nodes`` runs the same soak across two real Ray nodes (``pdserve.soak.netns``: two network
namespaces joined by a veth pair, Ray token auth): prefill on the head, decode on the worker node,
so every KV cache crosses the link, and the killed decode worker is the remote one. Needs root.
``--address`` (with ``--prefill-resource``/``--decode-resource``) runs it on a Ray cluster of your own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import grpc

from pdserve.router.client import Client, make_request
from pdserve.soak.soak_requests import SoakRequest, build_requests, send_request


def _kill(cluster, role: str) -> tuple[str, float]:
    import ray

    w = next(s for s in cluster.supervisor.workers if s.role == role)
    os.kill(ray.get(w.actor.pid.remote(), timeout=10), signal.SIGKILL)
    return w.address, time.monotonic()


async def _wait_recovered(cluster, old: str, since: float, limit_s: float = 60.0) -> float:
    """Seconds from the kill until the router routes to the worker's replacement."""
    while time.monotonic() - since < limit_s:
        if old not in cluster.workers:
            async with Client(cluster.address) as c:
                try:
                    res = await c.generate(make_request("", prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=10)
                    if not res.error:
                        return time.monotonic() - since
                except grpc.aio.AioRpcError:
                    pass
        await asyncio.sleep(0.2)
    return float("nan")


async def _run_load(cluster, requests: list[SoakRequest], kills: list[str]) -> list[tuple[str, float]]:
    t0 = time.monotonic()
    span = max(r.send_at_s for r in requests)
    recoveries = []
    async with Client(cluster.address) as client:
        tasks = [asyncio.create_task(send_request(client, r, t0)) for r in requests]
        for k, role in enumerate(kills):  # evenly through the run
            await asyncio.sleep(max(0.0, t0 + span * (k + 1) / (len(kills) + 1) - time.monotonic()))
            old, at = _kill(cluster, role)
            recoveries.append((role, await _wait_recovered(cluster, old, at)))
        await asyncio.gather(*tasks)
    return recoveries


def run_soak(
    model: str = "embedded",
    num_requests: int = 1000,
    rate: float = 8.0,
    kills=("decode", "prefill"),
    cancel_frac: float = 0.10,
    deadline_frac: float = 0.05,
    length_scale: float = 0.1,
    seed: int = 0,
    ray_address: str | None = None,
    prefill_resource: str | None = None,
    decode_resource: str | None = None,
) -> dict:
    """Run the soak and return its figures (``summary_lines`` formats them). ``ray_address``: join
    that Ray cluster instead of starting a local one; ``*_resource``: pin each role (ClusterConfig)."""
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.soak.checks import greedy_mismatches, scrape_migrations, settled_blocks

    model_dir = resolve_model_dir(model)
    mc = ModelConfig.from_folder(model_dir)
    max_len = min(mc.max_position_embeddings, 1024)
    requests = build_requests(
        num_requests, rate, mc.vocab_size, max_len, seed, cancel_frac, deadline_frac, length_scale
    )
    engine_cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=max_len, kv_cache_gib=1.0)
    t = time.monotonic()
    cfg = ClusterConfig(
        engine=engine_cfg,
        placement="split",
        router_port=0,
        http_port=0,
        ray_address=ray_address,
        prefill_resource=prefill_resource,
        decode_resource=decode_resource,
    )
    with start_cluster(cfg) as cluster:
        recoveries = asyncio.run(_run_load(cluster, requests, list(kills)))
        used = asyncio.run(settled_blocks(cluster))
        migrated = scrape_migrations(cluster.http_address)
    elapsed = time.monotonic() - t
    mismatches = greedy_mismatches(engine_cfg, [r for r in requests if r.outcome == "completed"])
    return {
        "requests": len(requests),
        "elapsed_s": elapsed,
        "outcomes": Counter(r.outcome for r in requests),
        "by_action": {
            a: dict(Counter(r.outcome for r in requests if r.action == a)) for a in ("normal", "cancel", "deadline")
        },
        "actions": Counter(r.action for r in requests),
        "migrated": migrated,
        "used_blocks": used,
        "mismatches": mismatches,
        "recoveries": recoveries,
        "hung": sum(r.outcome in ("hung", "") for r in requests),
    }


def summary_lines(s: dict) -> list[str]:
    o = s["outcomes"]
    failed = {k: v for k, v in o.items() if k not in ("completed", "cancelled", "hung", "")}
    lines = [
        f"{s['requests']} requests in {s['elapsed_s']:.0f}s (asked: {dict(s['actions'])})",
        f"completed {o.get('completed', 0)} (of which migrated {s['migrated']}), cancelled by the client "
        f"{o.get('cancelled', 0)}, failed with a status {sum(failed.values())} {failed or ''}",
        f"outcomes by what the client did: {s['by_action']}",
        f"hung {s['hung']} (must be 0)",
        f"used KV blocks at the end: {s['used_blocks']} (must be 0)",
        f"greedy mismatches against an undisturbed run: {s['mismatches']} (must be 0)",
    ]
    lines += [f"{role} worker killed: serving again after {sec:.1f}s" for role, sec in s["recoveries"]]
    return lines


def cmd_soak(args) -> int:
    if args.cancel_frac + args.deadline_frac > 1.0:
        raise ValueError("--cancel-frac + --deadline-frac must be <= 1")
    if args.two_nodes:
        if args.address or args.prefill_resource or args.decode_resource:
            raise ValueError("--two-nodes makes its own Ray cluster: drop --address and the --*-resource flags")
        return _soak_on_two_nodes(args)
    s = run_soak(
        args.model or "embedded",
        args.num_requests,
        args.rate,
        list(args.kills),
        args.cancel_frac,
        args.deadline_frac,
        args.length_scale,
        args.seed,
        args.address,
        args.prefill_resource,
        args.decode_resource,
    )
    for line in summary_lines(s):
        print(line)
    plain = s["by_action"]["normal"]
    ok = s["hung"] == 0 and not any(s["used_blocks"].values()) and s["mismatches"] == 0 and set(plain) <= {"completed"}
    if set(plain) - {"completed"}:
        print(f"plain requests that did not complete: { {k: v for k, v in plain.items() if k != 'completed'} }")
    if args.overload_s and not args.address:
        from pdserve.soak.overload import overload_lines, overload_ok, run_overload

        o = run_overload(args.model or "embedded", args.overload_s, length_scale=args.length_scale, seed=args.seed)
        print("\n".join(overload_lines(o)))
        ok = ok and overload_ok(o)
    return 0 if ok else 1


def _soak_on_two_nodes(args) -> int:
    """This soak again, on two fresh Ray nodes in network namespaces (torn down after)."""
    from pdserve.soak.ray_nodes import run_on_two_nodes

    flags = [
        "--num-requests",
        str(args.num_requests),
        "--rate",
        repr(args.rate),
        "--kills",
        ",".join(args.kills),
        "--cancel-frac",
        repr(args.cancel_frac),
        "--deadline-frac",
        repr(args.deadline_frac),
        "--length-scale",
        repr(args.length_scale),
        "--seed",
        str(args.seed),
        "--overload-s",
        "0",
    ]
    flags += ["--model", args.model] if args.model else []
    # the run's own waits are bounded well within this
    return run_on_two_nodes(["soak", *flags], timeout_s=args.num_requests / args.rate + 1800.0)


def _kills(text: str) -> tuple[str, ...]:
    import argparse

    roles = tuple(k.strip() for k in text.split(",") if k.strip())
    if bad := [k for k in roles if k not in ("decode", "prefill")]:
        raise argparse.ArgumentTypeError(f"unknown worker role(s) {', '.join(bad)}: use decode and/or prefill")
    return roles


def add_soak_parser(sub) -> None:
    from pdserve.cluster.flags import add_role_resource_args
    from pdserve.worker.flags import fraction, non_negative_int, positive_float, positive_int

    p = sub.add_parser("soak", help="a split cluster under a trace, cancels, deadlines and worker kills (bounded)")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--num-requests", type=positive_int, default=1000)
    p.add_argument("--rate", type=positive_float, default=8.0, help="mean request rate, req/s")
    p.add_argument(
        "--kills",
        type=_kills,
        default=("decode", "prefill"),
        help="workers to kill in turn mid-run: decode and/or prefill, comma-separated ('' = none)",
    )
    p.add_argument("--cancel-frac", type=fraction, default=0.10, help="share of requests their client cancels")
    p.add_argument(
        "--deadline-frac", type=fraction, default=0.05, help="share of requests with a deadline too tight to make"
    )
    p.add_argument("--length-scale", type=positive_float, default=0.1)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument(
        "--overload-s",
        type=non_negative_int,
        default=60,
        help="then twice the measured capacity for this many seconds on 2 + 2 workers (0: skip)",
    )
    p.add_argument(
        "--two-nodes",
        action="store_true",
        help="across two real Ray nodes in two network namespaces (root): prefill on one, decode on the other",
    )
    p.add_argument("--address", default=None, help="Ray cluster to join (default: a local Ray instance)")
    add_role_resource_args(p)
    p.set_defaults(func=cmd_soak)
