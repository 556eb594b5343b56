"""Measure the serving path around the engine: what a token costs between the engine's step and
the client, on this machine (the ``serving`` section of ``pdserve profile``).

A real colocated worker runs in its own process (``multiprocessing`` spawn, the profile's engine
settings); the real router (``router.grpc_api.serve``) and a real gRPC client run in this process,
all on loopback. Each point sends ``batch`` greedy requests of ``prompt_tokens`` random tokens at
once and reads ``output_tokens`` tokens of each (``ignore_eos``), and records:

- ``wall_s``: from the first send to the last token read;
- ``engine_s``: the worker's time in model steps over the point (``WorkerStats`` busy counters);
- ``steps``: ``output_tokens``, one decode step per token (the prompts' prefill step included);
- ``router_cpu_s``: this process's CPU time (``time.process_time``): the router and the client;
- ``worker_cpu_s``: the worker process's CPU time (``psutil``, clock-tick resolution).

``fit_serving`` turns the points into the ``serving`` fit: ``s0 + s1*b`` seconds of wall time per
step beyond the engine's (the worker's event loop taking the step's tokens, one gRPC message per
request and step, waits for the GIL), and ``r0`` per request plus ``r1`` per token of router and
client CPU. ``planner/simulate.py`` charges both (``planner/host_cpu.py``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from collections.abc import Callable

from pdserve.engine.config import EngineConfig
from pdserve.planner.step_model import error_stats, fit_relative

SERVING_UNITS = {"s0": "s", "s1": "s/sequence", "r0": "s/request", "r1": "s/token"}
SERVING_FORMULA = "wall per step beyond the engine: s0 + s1*b; router and client CPU: r0*requests + r1*tokens"
DEFAULT_BATCHES = (1, 4, 16, 32)
DEFAULT_OUTPUTS = (16, 64)
PROMPT_TOKENS = 16


def _worker_main(cfg: EngineConfig, conn) -> None:
    """Child process: serve one colocated worker; send its address, then serve until told to stop."""
    import pdserve.colocated_worker.worker as colocated

    async def main() -> None:
        running = await colocated.serve(cfg)
        conn.send(running.address)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await running.stop()

    asyncio.run(main())


async def _busy_s(address: str) -> float:
    from pdserve.rpc.auth import internal_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    async with internal_channel(address, None) as ch:
        s = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
    return (s.prefill_busy_ns + s.decode_busy_ns) / 1e9


async def _measure(
    cfg: EngineConfig, address: str, worker_pid: int, points: list[tuple[int, int]], say: Callable[[str], None]
) -> list[dict]:
    import psutil

    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.router import grpc_api
    from pdserve.router.client import Client, make_request

    model_dir = resolve_model_dir(cfg.model)
    router = await grpc_api.serve(model_dir, colocated=[address])
    worker, rng, out, vocab = psutil.Process(worker_pid), random.Random(0), [], router.core.vocab_size
    try:
        async with Client(router.address) as client:

            async def one(b: int, n: int) -> dict:
                prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(b)]
                reqs = [make_request("", n, temperature=0.0, ignore_eos=True, prompt_token_ids=p) for p in prompts]
                busy0, cpu0, w0 = await _busy_s(address), time.process_time(), worker.cpu_times()
                t0 = time.perf_counter()
                results = await asyncio.gather(*(client.generate(r) for r in reqs))
                wall = time.perf_counter() - t0
                cpu, w1, busy1 = time.process_time() - cpu0, worker.cpu_times(), await _busy_s(address)
                bad = [r.error for r in results if r.error or len(r.token_ids) != n]
                if bad:
                    raise RuntimeError(f"serving probe: a request failed: {bad[0] or 'too few tokens'}")
                return {
                    "batch": b,
                    "output_tokens": n,
                    "prompt_tokens": PROMPT_TOKENS,
                    "steps": n,
                    "wall_s": wall,
                    "engine_s": busy1 - busy0,
                    "router_cpu_s": cpu,
                    "worker_cpu_s": (w1.user + w1.system) - (w0.user + w0.system),
                }

            await one(points[0][0], 8)  # warm-up: first calls, the kernels of these shapes
            for b, n in points:
                point = await one(b, n)
                out.append(point)
                say(
                    f"serving batch {b:>3} x {n:>3} tokens: {point['wall_s'] / n * 1e3:6.2f} ms a step "
                    f"({point['engine_s'] / n * 1e3:.2f} ms engine), router+client CPU "
                    f"{point['router_cpu_s'] / (b * n) * 1e6:.0f} us a token"
                )
    finally:
        await router.stop()
    return out


def measure_serving(
    cfg: EngineConfig,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    outputs: tuple[int, ...] = DEFAULT_OUTPUTS,
    say: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """The serving points (see the module docstring) for each batch size and output length, a
    worker of ``cfg`` in a child process. RuntimeError when the worker does not start or a request
    fails."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(cfg, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("serving probe: the worker did not start within 300 s")
        address = parent.recv()
        points = [(b, n) for b in batches for n in outputs]
        return asyncio.run(_measure(cfg, address, proc.pid, points, say))
    finally:
        if proc.is_alive():
            try:
                parent.send("stop")
            except OSError:
                pass
            proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def fit_serving(points: list[dict]) -> dict:
    """The ``serving`` fit of serving points (see the module docstring): ``s0``, ``s1`` from the
    wall time per step beyond the engine against the batch, ``r0``, ``r1`` from the router and client
    CPU against requests and tokens; each with its error. ValueError with fewer than 2 points."""
    if len(points) < 2:
        raise ValueError(f"the serving fit needs at least 2 points, got {len(points)}")
    extra = [max(1e-6, (q["wall_s"] - q["engine_s"]) / q["steps"]) for q in points]  # the fit wants > 0
    s0, s1 = fit_relative([[1, q["batch"]] for q in points], extra)
    cpu = [q["router_cpu_s"] for q in points]
    r0, r1 = fit_relative([[q["batch"], q["batch"] * q["output_tokens"]] for q in points], cpu)
    values = {"s0": s0, "s1": s1, "r0": r0, "r1": r1}
    return {
        "formula": SERVING_FORMULA,
        "coefficients": {k: {"value": v, "unit": SERVING_UNITS[k]} for k, v in values.items()},
        "error": error_stats([s0 + s1 * q["batch"] for q in points], extra),
        "router_cpu_error": error_stats([r0 * q["batch"] + r1 * q["batch"] * q["output_tokens"] for q in points], cpu),
    }


def add_serving(profile: dict, cfg: EngineConfig, quick: bool, say: Callable[[str], None]) -> None:
    """Measure the serving path (``measure_serving``; ``quick``: two small batches of short
    outputs) and add its points and fit to ``profile`` in place (``points.serving``,
    ``fits.serving``), its time to ``elapsed_s``."""
    start = time.perf_counter()
    batches, outputs = ((1, 4), (8, 16)) if quick else (DEFAULT_BATCHES, DEFAULT_OUTPUTS)
    points = measure_serving(cfg, batches, outputs, say)
    profile["points"]["serving"] = points
    profile["fits"]["serving"] = fit_serving(points)
    profile["elapsed_s"] = profile.get("elapsed_s", 0.0) + time.perf_counter() - start
