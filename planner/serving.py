"""Measure the serving path around the engine: what a request and a token cost between the
engine's steps and the client, on this machine (the ``serving`` and ``serving_split`` sections of
``pdserve profile``).

Each placement's real workers run in their own processes (``multiprocessing`` spawn, the profile's
engine settings), each pinned to its own cores as ``pdserve serve`` pins them: one colocated worker,
or a prefill and a decode worker. The real router
(``router.grpc_api.serve``) and a real gRPC client run in this process, all on loopback.

- **Batch points:** ``batch`` greedy requests of ``prompt_tokens`` random tokens sent at once, each
  reading ``output_tokens`` tokens (``ignore_eos``). Recorded: ``wall_s`` (first send to last token
  read), ``engine_s`` (the workers' time in model steps, summed, ``WorkerStats`` busy counters), ``steps``
  (``output_tokens``: one decode step per token, the prompts' prefill step included),
  ``router_cpu_s`` (this process's CPU time: the router and the client) and ``worker_cpu_s`` (the
  workers' processes, ``psutil``, clock-tick resolution).
- **First-token points:** one request at a time, each after ``FIRST_TOKEN_GAP_S`` of idleness (as
  requests meet a lightly loaded server), with a prompt of each of ``FIRST_TOKEN_PROMPTS`` tokens
  (two output tokens). Recorded: ``ttft_s`` at the client and the worker's ``queue_s`` and
  ``prefill_s`` (its ``Timings``).
- **Load points** (planner/serving_load.py): each placement's workers (colocated: one per core)
  under a steady Poisson load, their engine steps traced.

``planner/serving_fit.py`` fits them against the engine's step model.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

from pdserve.engine.config import EngineConfig
from pdserve.planner.budget import ServingPlan
from pdserve.planner.serving_fit import fit_serving
from pdserve.planner.step_model import StepModel
from pdserve.worker.cpus import cpu_shares, pin_process

DEFAULT_BATCHES = (1, 4, 16, 32)
DEFAULT_OUTPUTS = (16, 64)
PROMPT_TOKENS = 16
FIRST_TOKEN_PROMPTS = (64, 256, 1024)
FIRST_TOKEN_REPEATS = 5
FIRST_TOKEN_GAP_S = 0.2  # idle before each first-token request: what a request sees below saturation
PLACEMENTS = {"colocated": ("colocated",), "split": ("prefill", "decode")}
SECTIONS = {"colocated": "serving", "split": "serving_split"}  # fits.<section> of each placement


def _worker_main(role: str, cfg: EngineConfig, cpus: list[int] | None, conn, trace_dir: str | None) -> None:
    """Child process: serve one worker of ``role``, pinned to ``cpus`` (None: not pinned), tracing
    its steps to ``trace_dir`` (None: no trace); send its address, then serve until told to stop."""
    import importlib

    from pdserve.worker import step_trace

    if trace_dir:
        os.environ[step_trace.ENV] = trace_dir
    if cpus:
        pin_process(cpus)
    worker = importlib.import_module(f"pdserve.{role}_worker.worker")

    async def main() -> None:
        running = await worker.serve(cfg)
        conn.send(running.address)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await running.stop()

    asyncio.run(main())


async def _busy_s(addresses: list[str]) -> float:
    from pdserve.rpc.auth import internal_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    total = 0.0
    for address in addresses:
        async with internal_channel(address, None) as ch:
            s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
        total += (s.prefill_busy_ns + s.decode_busy_ns) / 1e9
    return total


async def _measure(
    placement: str,
    cfg: EngineConfig,
    workers: list[tuple[str, str, int]],
    points: list[tuple[int, int]],
    prompts: tuple[int, ...],
    say: Callable[[str], None],
) -> tuple[list[dict], list[dict]]:
    import psutil

    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.router import grpc_api
    from pdserve.router.client import Client, make_request

    addresses = [a for _, a, _ in workers]
    procs = [psutil.Process(pid) for _, _, pid in workers]
    router = await grpc_api.serve(resolve_model_dir(cfg.model), **by_role(workers))
    rng, batch_points, first_points, vocab = random.Random(0), [], [], router.core.vocab_size

    def worker_cpu() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    try:
        async with Client(router.address) as client:

            async def one(b: int, n: int) -> dict:
                prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(b)]
                reqs = [make_request("", n, temperature=0.0, ignore_eos=True, prompt_token_ids=p) for p in prompts]
                busy0, cpu0, w0 = await _busy_s(addresses), time.process_time(), worker_cpu()
                t0 = time.perf_counter()
                results = await asyncio.gather(*(client.generate(r) for r in reqs))
                wall = time.perf_counter() - t0
                cpu, w1, busy1 = time.process_time() - cpu0, worker_cpu(), await _busy_s(addresses)
                bad = [r.error for r in results if r.error or len(r.token_ids) != n]
                if bad:
                    raise RuntimeError(f"serving probe: a request failed: {bad[0] or 'too few tokens'}")
                return {
                    "placement": placement,
                    "batch": b,
                    "output_tokens": n,
                    "prompt_tokens": PROMPT_TOKENS,
                    "steps": n,
                    "wall_s": wall,
                    "engine_s": busy1 - busy0,
                    "router_cpu_s": cpu,
                    "worker_cpu_s": w1 - w0,
                }

            async def lone(n: int) -> dict:
                await asyncio.sleep(FIRST_TOKEN_GAP_S)
                ids = [rng.randrange(vocab) for _ in range(n)]
                req = make_request("", 2, temperature=0.0, ignore_eos=True, prompt_token_ids=ids)
                t0, ttft, timings = time.perf_counter(), None, None
                async for msg in client.stream(req):
                    kind = msg.WhichOneof("kind")
                    if kind == "chunk" and ttft is None:
                        ttft = time.perf_counter() - t0
                    elif kind == "complete":
                        timings = msg.complete.timings
                    elif kind == "error":
                        raise RuntimeError(f"serving probe: a request failed: {msg.error.message}")
                if ttft is None or timings is None:
                    raise RuntimeError("serving probe: a request ended without its first token")
                return {
                    "placement": placement,
                    "prompt_tokens": n,
                    "ttft_s": ttft,
                    "queue_s": timings.queue_ns / 1e9,
                    "prefill_s": timings.prefill_ns / 1e9,
                }

            await one(points[0][0], 8)  # warm-up: first calls, the kernels of these shapes
            for b, n in points:
                point = await one(b, n)
                batch_points.append(point)
                say(
                    f"serving {placement:9} batch {b:>3} x {n:>3} tokens: {point['wall_s'] / n * 1e3:6.2f} ms a step "
                    f"({point['engine_s'] / n * 1e3:.2f} ms engine), router+client CPU "
                    f"{point['router_cpu_s'] / (b * n) * 1e6:.0f} us a token"
                )
            for n in prompts:
                await lone(n)  # warm-up: this prompt length's kernels
                runs = [await lone(n) for _ in range(FIRST_TOKEN_REPEATS)]
                first_points += runs
                ttft = statistics.median(r["ttft_s"] for r in runs)
                say(f"serving {placement:9} first token of {n:>5} prompt tokens: {ttft * 1e3:7.2f} ms (median)")
    finally:
        await router.stop()
    return batch_points, first_points


def measure_serving(
    cfg: EngineConfig,
    placement: str = "colocated",
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    outputs: tuple[int, ...] = DEFAULT_OUTPUTS,
    prompts: tuple[int, ...] = FIRST_TOKEN_PROMPTS,
    say: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict], list[dict]]:
    """The batch and first-token points (see the module docstring) of ``placement`` (``colocated``
    or ``split``), its workers of ``cfg`` in child processes. RuntimeError when a worker does not
    start or a request fails."""
    with running_workers(cfg, PLACEMENTS[placement]) as workers:
        points = [(b, n) for b in batches for n in outputs]
        return asyncio.run(_measure(placement, cfg, workers, points, prompts, say))


def by_role(workers: list[tuple[str, str, int]]) -> dict[str, list[str]]:
    """``running_workers``' workers as the router takes them: role -> addresses."""
    roles: dict[str, list[str]] = {}
    for role, address, _ in workers:
        roles.setdefault(role, []).append(address)
    return roles


@contextlib.contextmanager
def running_workers(cfg: EngineConfig, roles: tuple[str, ...], trace_dir: str | None = None):
    """A worker of each of ``roles`` (of ``cfg``) in a child process, each pinned to cores of its
    own as ``pdserve serve`` pins them, tracing its steps to ``trace_dir`` when given: yields
    ``[(role, address, pid), ...]``, and stops them on exit. RuntimeError when one does not start."""
    ctx = multiprocessing.get_context("spawn")
    started = []
    pin = cfg.device == "cpu" and sys.platform.startswith("linux")  # as pdserve serve pins its CPU workers
    shares = cpu_shares(len(roles), cfg.torch_threads or 1, os.cpu_count() or 1) if pin else None
    try:
        for i, role in enumerate(roles):
            parent, child = ctx.Pipe()
            cpus = shares[i] if shares else None
            proc = ctx.Process(target=_worker_main, args=(role, cfg, cpus, child, trace_dir), daemon=True)
            proc.start()
            started.append((role, proc, parent))
        workers = []
        for role, proc, parent in started:
            if not parent.poll(300):
                raise RuntimeError(f"serving probe: the {role} worker did not start within 300 s")
            try:
                workers.append((role, parent.recv(), proc.pid))
            except EOFError:
                why = f"the {role} worker exited as it started (exit code {proc.exitcode})"
                raise RuntimeError(f"serving probe: {why}") from None
        yield workers
    finally:
        stop_processes([(proc, parent) for _, proc, parent in started])


def stop_processes(procs: list[tuple]) -> None:
    """Ask each live child process of ``procs`` (``(process, its end of the pipe or None)``) to stop,
    then wait up to 30 s for each and kill what is left."""
    for proc, conn in procs:
        if conn is not None and proc.is_alive():
            try:
                conn.send("stop")
            except OSError:
                pass
    for proc, _ in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def serving_plan(cfg: EngineConfig, quick: bool, room: int, model: StepModel) -> ServingPlan:
    """What ``add_serving`` runs (``quick``: two small batches of short outputs, two prompt
    lengths, a third as many load requests), prompts cut to ``room`` tokens, the loads' rates from
    ``model``'s prefill time (planner/serving_load.py)."""
    from pdserve.planner.serving_load import LOAD_OUTPUTS, LOAD_PROMPT, LOAD_REQUESTS, load_rate, load_roles

    batches, outputs = ((1, 4), (8, 16)) if quick else (DEFAULT_BATCHES, DEFAULT_OUTPUTS)
    prompts = tuple(sorted({min(n, room) for n in (FIRST_TOKEN_PROMPTS[:2] if quick else FIRST_TOKEN_PROMPTS)}))
    n = min(LOAD_PROMPT, room)
    rates = tuple(load_rate(load_roles(p, cfg), model.prefill_s(n)) for p in SECTIONS)
    requests = LOAD_REQUESTS // 3 if quick else LOAD_REQUESTS
    first = (prompts, FIRST_TOKEN_REPEATS, FIRST_TOKEN_GAP_S)
    return ServingPlan(batches, outputs, PROMPT_TOKENS, *first, requests, n, LOAD_OUTPUTS, rates)


def add_serving(profile: dict, cfg: EngineConfig, plan: ServingPlan, say: Callable[[str], None]) -> None:
    """Measure the serving path of each placement (``measure_serving``, the batches, outputs and
    first-token prompts of ``plan``, see ``serving_plan``) and add the points (``points.serving``,
    ``points.first_token``), the load points' steps (``plan.load_requests`` requests), and each
    placement's fit (``fits.serving``, ``fits.serving_split``, planner/serving_fit.py: the load
    points' summary in its ``load``) to ``profile`` in place, their time to ``elapsed_s``."""
    from pdserve.planner.serving_load import measure_load

    start = time.perf_counter()
    model = StepModel.from_profile(profile)
    room = profile["settings"]["max_model_len"] - 2
    profile["points"]["serving"], profile["points"]["first_token"] = [], []
    for placement, section in SECTIONS.items():
        points, first = measure_serving(cfg, placement, plan.batches, plan.outputs, plan.first_token_prompts, say)
        load = measure_load(cfg, placement, model, room, plan.load_requests, say)
        profile["points"]["serving"] += points
        profile["points"]["first_token"] += first
        profile["fits"][section] = fit_serving(points, first, model, placement, load)
    profile["elapsed_s"] = profile.get("elapsed_s", 0.0) + time.perf_counter() - start
