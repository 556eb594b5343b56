"""The load points of ``pdserve profile``'s serving probe: a placement's workers, router and load
generator as a deployment runs them, under a steady load (``k_prompt_load``, ``k_decode_load``,
``cpu_token_load``, planner/serving_fit.py).

The profile's engine points run alone on an idle machine. A serving worker's steps share its core
with the worker's own threads (the event loop streaming the last step's tokens, gRPC), and the
machine with the other workers' steps, the router and the clients. A 2-core AMX Xeon serving W2 at
8 req/s on 2 colocated workers (docs/measurements.md): prompt steps 1.10-1.27x the profile's
engine, decode steps 1.04-1.24x, the engine threads holding 84-95 % of their cores; the router
process used 0.10 cores and the load generator 0.16.

So the load runs each worker in a process of its own, pinned to cores of its own
(``running_workers``): colocated, one worker per core share (``LOAD_WORKERS`` at most); split, a
prefill and a decode worker. The router runs in another process, unpinned, and the load generator
(loadgen's, as ``pdserve bench`` sends) in a third. After one warm-up request per worker,
``requests`` requests of ``LOAD_PROMPT`` random tokens (fewer when the model's length is shorter)
arrive at Poisson times, at ``load_rate``: the same rate for both placements of as many workers,
the one that keeps every worker ``LOAD_PREFILL_SHARE`` busy with prompts when each prefills its own
(colocated), so a split pair's prefill worker is twice that busy. A lighter split load measured
other factors than a run at the colocated rate meets: on a 2-core AMD EPYC (AVX2), the split load at
half the rate read prefill steps 1.05x and decode steps 0.76x the profile's engine, and a W2 run at
the colocated rate traced 1.26x and 1.01x (docs/measurements.md). The first half reads
``LOAD_OUTPUTS[0]`` output tokens a request, the second ``LOAD_OUTPUTS[1]``. Each worker traces
its engine steps (worker/step_trace.py); the points are the steps that started while the load ran,
by role, and for each half the CPU time the router's and the load generator's processes spent.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.planner.serving import by_role, running_workers, stop_processes
from pdserve.planner.step_model import StepModel
from pdserve.worker.step_trace import read_steps, trace_file

LOAD_REQUESTS = 48
LOAD_OUTPUTS = (16, 64)  # the load's two halves: their CPU apart gives a request's and a token's
LOAD_PROMPT = 256
LOAD_PREFILL_SHARE = 0.3
LOAD_WORKERS = 4


def load_roles(placement: str, cfg: EngineConfig) -> tuple[str, ...]:
    """The workers of ``placement``'s load: colocated, one per ``cfg.torch_threads`` of this
    machine's cores (1 to ``LOAD_WORKERS``; one on a GPU, whose device they would share); split, a
    prefill and a decode worker."""
    if placement == "split":
        return ("prefill", "decode")
    if cfg.device != "cpu":
        return ("colocated",)
    per_core = (os.cpu_count() or 1) // (cfg.torch_threads or 1)
    return ("colocated",) * max(1, min(LOAD_WORKERS, per_core))


def load_rate(roles: tuple[str, ...], prefill_s: float) -> float:
    """Requests a second of the load on ``roles``' workers (``load_roles``) whose prompts take
    ``prefill_s`` seconds each: ``LOAD_PREFILL_SHARE`` of each worker's time in prompts were every
    worker prefilling its own (module docstring). ValueError unless ``prefill_s`` > 0."""
    if not prefill_s > 0:
        raise ValueError(f"a prompt's prefill time must be > 0 s, got {prefill_s}")
    return LOAD_PREFILL_SHARE * len(roles) / prefill_s


def measure_load(
    cfg: EngineConfig,
    placement: str,
    model: StepModel,
    max_prompt: int,
    requests: int = LOAD_REQUESTS,
    say: Callable[[str], None] = lambda _: None,
) -> dict:
    """The load points of ``placement`` (``colocated`` or ``split``), prompts of ``LOAD_PROMPT``
    tokens at most ``max_prompt``, the rate from ``model``'s prefill time (module docstring):
    ``steps`` (each role's traced steps, worker/step_trace.py lines), ``rate_rps`` and ``halves``,
    each ``{"requests", "output_tokens", "router_cpu_s", "client_cpu_s", "wall_s"}`` (CPU seconds
    of the router's process and of the load generator). RuntimeError when a worker or the router
    does not start or a request fails."""
    roles = load_roles(placement, cfg)
    n = min(LOAD_PROMPT, max_prompt)
    rate = load_rate(roles, model.prefill_s(n))
    with (
        tempfile.TemporaryDirectory(prefix="pdserve-load-steps-") as trace_dir,
        running_workers(cfg, roles, trace_dir) as workers,
    ):
        load = _load(cfg, workers, Path(trace_dir), n, rate, requests)
    counts = ", ".join(f"{role} {len(s)}" for role, s in load["steps"].items())
    cores = " and ".join(f"{(h['router_cpu_s'] + h['client_cpu_s']) / h['wall_s']:.2f}" for h in load["halves"])
    say(
        f"serving {placement:9} load of {requests} requests at {rate:.1f}/s on {len(roles)} workers: steps "
        f"{counts}; router + client CPU {cores} cores"
    )
    return load


def _router_main(model_dir: str, roles: dict[str, list[str]], conn) -> None:
    """Child process: the router of ``roles``' workers; send its address, serve until told to stop."""
    from pdserve.router import grpc_api

    async def main() -> None:
        router = await grpc_api.serve(Path(model_dir), **roles)
        conn.send(router.address)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await router.stop()

    asyncio.run(main())


def _load(cfg: EngineConfig, workers: list, trace_dir: Path, n: int, rate: float, requests: int) -> dict:
    from pdserve.engine.models.loader import resolve_model_dir

    ctx = multiprocessing.get_context("spawn")
    router_conn, child = ctx.Pipe()
    router = ctx.Process(
        target=_router_main, args=(str(resolve_model_dir(cfg.model)), by_role(workers), child), daemon=True
    )
    router.start()
    client = None
    try:
        if not router_conn.poll(120):
            raise RuntimeError("serving probe: the router did not start within 120 s")
        client_conn, child = ctx.Pipe()
        args = (router_conn.recv(), router.pid, len(workers), n, rate, requests, child)
        client = ctx.Process(target=_client_main, args=args, daemon=True)
        client.start()
        if not client_conn.poll(600):
            raise RuntimeError("serving probe: the load did not end within 600 s")
        out = client_conn.recv()
    except EOFError:
        raise RuntimeError("serving probe: the load generator exited without an answer") from None
    finally:
        stop_processes([(p, c) for p, c in ((client, None), (router, router_conn)) if p is not None])
    if "error" in out:
        raise RuntimeError(f"serving probe: {out['error']}")
    start_ns, end_ns = out.pop("window_ns")
    steps: dict[str, list[dict]] = {}
    for role, _, pid in workers:  # the steps that started while the load ran
        traced, _ = read_steps(trace_file(trace_dir, pid))
        steps.setdefault(role, []).extend(s for s in traced if start_ns <= s["t0"] < end_ns)
    return {**out, "steps": steps, "rate_rps": rate}


def _client_main(address: str, router_pid: int, warm_ups: int, n: int, rate: float, requests: int, conn) -> None:
    """Child process: the load generator, as ``pdserve bench`` is one (its CPU is its own, not the
    profile's); sends the halves and the monotonic ns window of the load, or ``{"error": ...}``."""
    try:
        conn.send(asyncio.run(_send(address, router_pid, warm_ups, n, rate, requests)))
    except Exception as exc:  # the parent turns it into its RuntimeError
        conn.send({"error": f"a load request failed: {exc}"})


async def _send(address: str, router_pid: int, warm_ups: int, n: int, rate: float, requests: int) -> dict:
    import psutil

    from pdserve.loadgen.runner import run_load
    from pdserve.loadgen.targets import GrpcBackend
    from pdserve.loadgen.workload import RequestSpec, poisson_arrivals

    rng, router = random.Random(1), psutil.Process(router_pid)
    async with GrpcBackend(address) as backend:
        vocab = (await backend.client.model_info()).vocab_size or 1000

        def specs(times: list[float], output_tokens: int) -> list[RequestSpec]:
            return [
                RequestSpec(i, t, tuple(rng.randrange(vocab) for _ in range(n)), output_tokens, "random")
                for i, t in enumerate(times)
            ]

        await run_load(backend, specs([0.0] * warm_ups, 4), run_id="warm-up")  # one a worker
        start_ns, halves = time.monotonic_ns(), []
        for i, output_tokens in enumerate(LOAD_OUTPUTS):
            count = requests // 2 if i == 0 else requests - requests // 2
            cpu0, client0, t0 = _cpu_s(router), time.process_time(), time.perf_counter()
            records = await run_load(backend, specs(poisson_arrivals(rate, count, i), output_tokens), run_id=f"load{i}")
            bad = [r for r in records if r.error or len(r.token_times_s) != output_tokens]
            if bad or len(records) != count:
                raise RuntimeError(bad[0].error if bad else "not sent")
            halves.append(
                {
                    "requests": count,
                    "output_tokens": count * output_tokens,
                    "router_cpu_s": _cpu_s(router) - cpu0,
                    "client_cpu_s": time.process_time() - client0,
                    "wall_s": time.perf_counter() - t0,
                }
            )
    return {"halves": halves, "window_ns": (start_ns, time.monotonic_ns())}


def _cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system
