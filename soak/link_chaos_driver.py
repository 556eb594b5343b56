"""The driver of ``pdserve.soak.link_chaos``: its fault cases, and the client that runs them
against a cluster on two Ray nodes from inside the router's network namespace (it shapes and cuts
the link itself, as root). ``python -m pdserve.soak.link_chaos_driver SPEC_JSON`` runs the cases
SPEC names and prints their rows as one JSON line; ``link_chaos.run_link_chaos`` starts it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from pdserve.soak.link_faults import LinkFaultUnavailable, LinkShape, clear_link, set_link, shape_link
from pdserve.soak.netns import TwoNodes

PROMPT_TOKENS = 1536  # 3 MiB of float32 KV per request with the embedded model (2 KiB per token)
MAX_TOKENS = 16
REQUESTS_PER_CASE = 8
REQUEST_DEADLINE_S = 150.0  # each request's gRPC deadline: a request that runs into it counts as hung
KV_PUSH_DEADLINE_S = 30.0  # GrpcKvSender's timeout_s (prefill_worker/kv_sender.py)
DETECT_S = 30.0  # keepalive time + timeout (rpc/server.py): a call on a dead connection fails by then
RIDE_OUT_S = 12.0  # a cut this short is ridden out: TCP's resends (0.2, 0.6, ... 12.6 s) reach the peer in time
MIGRATION_WAIT_S = 30.0  # at most: the router waits this long for a worker the supervisor says is restarting
SERVICE_S = 30.0  # a case's requests end within this on the slow link without a fault (measured: ~14 s)
SETTLE_S = 90.0  # after the last request ended, for every worker to hold nothing (TCP resends back off)
CUT_WHEN_S = 60.0  # a cut waits at most this long for a KV push in flight, then cuts anyway
SLOW = LinkShape(rate_mbit=16)


@dataclass(frozen=True)
class FaultCase:
    """A link fault: ``shape`` for the whole case, and a cut of ``cut_s`` seconds once a KV push is
    in flight (0: none). ``must_complete``: every request must complete (no error is acceptable)."""

    name: str
    shape: LinkShape = LinkShape()
    cut_s: float = 0.0
    must_complete: bool = True

    def __str__(self) -> str:
        cut = f"cut {self.cut_s:g} s mid-push" if self.cut_s else ""
        parts = [p for p in (str(self.shape) if self.shape != LinkShape() else "", cut) if p]
        return f"{self.name} ({', '.join(parts) or 'clean'})"

    @property
    def bound_s(self) -> float:
        """Seconds from its send within which each request must end: the time to serve the case
        undisturbed plus the cut; for a cut TCP may not ride out, the calls across it fail within
        DETECT_S (keepalive; the push deadline is as long), and the router then waits up to
        MIGRATION_WAIT_S for a live worker before it migrates the request or ends it with an error."""
        if self.cut_s <= RIDE_OUT_S:
            return SERVICE_S + self.cut_s
        return min(SERVICE_S + max(self.cut_s, DETECT_S) + MIGRATION_WAIT_S, REQUEST_DEADLINE_S - 1.0)


CASES = {
    c.name: c
    for c in (
        FaultCase("none"),
        FaultCase("slow", SLOW),
        FaultCase("loss", LinkShape(loss_pct=5)),
        FaultCase("delay", LinkShape(delay_ms=50)),
        FaultCase("cut-5s", SLOW, cut_s=5.0),
        FaultCase("cut-15s", SLOW, cut_s=15.0, must_complete=False),
        FaultCase("cut-35s", SLOW, cut_s=35.0, must_complete=False),
    )
}


@dataclass
class Outcome:
    """How one request ended: ``outcome`` is "completed", an error's status code name, or "hung"
    (still open at its deadline); seconds from its send to its first token and to its end."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    outcome: str = ""
    message: str = ""
    first_token_s: float = float("nan")
    second_token_s: float = float("nan")
    ended_s: float = float("nan")


async def _one(client, r: Outcome) -> None:
    from pdserve.router.client import make_request

    req = make_request(
        "", prompt_token_ids=r.prompt, max_tokens=r.max_tokens, temperature=0, ignore_eos=True, request_id=r.request_id
    )
    sent = time.monotonic()
    call = client.stub.Generate(req, timeout=REQUEST_DEADLINE_S)
    try:
        async for msg in call:
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                r.tokens += msg.chunk.token_ids
                if len(r.tokens) >= 1 and r.first_token_s != r.first_token_s:
                    r.first_token_s = time.monotonic() - sent
                if len(r.tokens) >= 2 and r.second_token_s != r.second_token_s:
                    r.second_token_s = time.monotonic() - sent
            elif kind == "complete":
                r.outcome = "completed"
            else:
                r.outcome, r.message = msg.error.code or "UNKNOWN", msg.error.message
    except grpc.aio.AioRpcError as exc:
        ran_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - sent >= REQUEST_DEADLINE_S - 1
        r.outcome, r.message = ("hung" if ran_out else exc.code().name), exc.details() or ""
    finally:
        r.ended_s = time.monotonic() - sent
        if not r.outcome:
            r.outcome, r.message = "INTERNAL", "the stream ended without a last message"


async def worker_load(workers: dict[str, str], secret: str | None) -> dict[str, int]:
    """Per worker ("role@address"): KV blocks used + sequences running or waiting + KV waits open;
    -1 for a worker whose stats did not answer. Seconds: each call waits up to 10."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    metadata = (("x-pdserve-cluster-secret", secret),) if secret else None
    load = {}
    for role, address in workers.items():
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(
                    worker_pb2.GetStatsRequest(), metadata=metadata, timeout=10
                )
                load[f"{role}@{address}"] = s.used_kv_blocks + s.num_running + s.num_waiting + s.num_awaiting_kv
            except grpc.aio.AioRpcError:
                load[f"{role}@{address}"] = -1
    return load


async def settled_load(
    workers: dict[str, str], secret: str | None, limit_s: float = SETTLE_S
) -> tuple[dict[str, int], float]:
    """``worker_load`` once it is 0 everywhere, or after ``limit_s`` seconds; and the seconds waited."""
    t0 = time.monotonic()
    while True:
        load = await worker_load(workers, secret)
        if not any(load.values()) or time.monotonic() - t0 > limit_s:
            return load, time.monotonic() - t0
        await asyncio.sleep(0.25)


def _metrics_migrations(http: str | None) -> int:
    if not http:
        return 0
    from pdserve.soak.checks import scrape_migrations

    return scrape_migrations(http)


async def _cut_when_in_flight(
    nodes: TwoNodes, case: FaultCase, reqs: list[Outcome], tasks: list[asyncio.Task]
) -> tuple[int, float]:
    """Cut the link for ``case.cut_s`` once a request has its first token and not its second (its KV
    push is under way), or after CUT_WHEN_S; returns how many requests were so at the cut, and
    the seconds from the first send to the cut."""
    t0 = time.monotonic()

    def in_flight() -> int:  # first_token_s is NaN until the first token
        return sum(1 for r in reqs if r.first_token_s == r.first_token_s and len(r.tokens) < 2)

    while not in_flight() and time.monotonic() - t0 < CUT_WHEN_S and not all(t.done() for t in tasks):
        await asyncio.sleep(0.02)
    at, n = time.monotonic() - t0, in_flight()
    await asyncio.to_thread(set_link, nodes, False)
    try:
        await asyncio.sleep(case.cut_s)
    finally:
        await asyncio.to_thread(set_link, nodes, True)
    return n, at


async def run_case(
    nodes: TwoNodes,
    router: str,
    http: str | None,
    workers: dict[str, str],
    secret: str | None,
    case: FaultCase,
    n: int,
    vocab: int,
    seed: int,
) -> tuple[dict, list[Outcome]]:
    """One case (see the module docstring): its table row and its requests. The row says
    ``skipped`` (why) when this machine cannot make the fault."""
    from pdserve.router.client import Client

    row = {"fault": str(case), "name": case.name, "requests": n, "bound_s": case.bound_s}
    try:
        row["how"] = await asyncio.to_thread(shape_link, nodes, case.shape) if case.shape != LinkShape() else "-"
    except LinkFaultUnavailable as exc:
        row["skipped"] = str(exc)
        return row, []
    rng = random.Random(f"{seed}-{case.name}")
    reqs = [
        Outcome(f"chaos-{case.name}-{i}", [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)], MAX_TOKENS)
        for i in range(n)
    ]
    migrations0 = _metrics_migrations(http)
    t0 = time.monotonic()
    try:
        async with Client(router) as client:
            tasks = [asyncio.create_task(_one(client, r)) for r in reqs]
            if case.cut_s:
                row["in_flight_at_cut"], row["cut_at_s"] = await _cut_when_in_flight(nodes, case, reqs, tasks)
            await asyncio.gather(*tasks)
    finally:
        await asyncio.to_thread(set_link, nodes, True)
        await asyncio.to_thread(clear_link, nodes)
    row["elapsed_s"] = time.monotonic() - t0
    load, row["settle_s"] = await settled_load(workers, secret)
    outcomes = Counter(r.outcome for r in reqs)
    row.update(
        completed=outcomes.pop("completed", 0),
        hung=outcomes.pop("hung", 0),
        errors=dict(outcomes),
        migrated=_metrics_migrations(http) - migrations0,
        max_end_s=max(r.ended_s for r in reqs),
        leaked=load,
        messages=sorted({f"{r.outcome}: {r.message}" for r in reqs if r.outcome != "completed"}),
        short=sum(r.outcome == "completed" and len(r.tokens) != r.max_tokens for r in reqs),
    )
    return row, reqs


def greedy_mismatches(model: str, done: list[Outcome]) -> int:
    """How many completed requests' tokens differ from the same prompts run undisturbed on one local
    engine (float32, greedy: each has one right answer)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.soak.checks import greedy_mismatches as mismatches

    return mismatches(EngineConfig(model=str(resolve_model_dir(model)), dtype="float32"), done) if done else 0


def drive(
    nodes: TwoNodes,
    router: str,
    http: str | None,
    workers: dict[str, str],
    secret: str | None,
    cases: list[FaultCase],
    n: int = REQUESTS_PER_CASE,
    model: str = "embedded",
    seed: int = 0,
    router_node: str = "",
) -> list[dict]:
    """Run ``cases`` in turn against the cluster whose router is at ``router`` (run it in the
    router's namespace); the table's rows, each with its greedy mismatches (``mismatches``) and
    ``router_node`` (as given). Progress goes to stderr."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.loader import resolve_model_dir

    vocab = ModelConfig.from_folder(resolve_model_dir(model)).vocab_size
    rows = []
    for case in cases:
        print(f"link chaos: {case} ...", file=sys.stderr, flush=True)
        row, reqs = asyncio.run(run_case(nodes, router, http, workers, secret, case, n, vocab, seed))
        row["router_node"] = router_node
        row["mismatches"] = greedy_mismatches(model, [r for r in reqs if r.outcome == "completed"])
        for r in reqs:
            print(
                f"  {r.request_id}: {r.outcome} after {r.ended_s:.1f}s (first token {r.first_token_s:.1f}s, second "
                f"{r.second_token_s:.1f}s, {len(r.tokens)} tokens) {r.message}",
                file=sys.stderr,
                flush=True,
            )
        print(f"link chaos: {json.dumps(row)}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    rows = drive(
        TwoNodes.attach(spec["nodes"]),
        spec["router"],
        spec["http"],
        spec["workers"],
        os.environ.get("PDSERVE_CLUSTER_SECRET"),
        [CASES[c] for c in spec["cases"]],
        spec["requests"],
        spec["model"],
        spec["seed"],
        spec["router_node"],
    )
    print(json.dumps(rows))
