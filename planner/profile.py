"""Measure one engine (``LLMEngine``, the code the workers run) on this machine: step times of
prefill, decode and mixed steps and the KV hand-off time, with the step-time model fitted to them.

Each point is the median of ``repeats`` timed runs, spread over a few passes over all the points
(a burst of other work on the machine then touches one pass, not every run of a point), each
pass of a point after ``warmup`` untimed runs of the same shape. A step is timed with
``time.perf_counter`` around ``LLMEngine.step()``, which returns once the sampled tokens are on the
host, so a GPU step is timed whole. The engine is driven directly (``add_request``, ``admit_kv``,
``step``), on a CPU with one thread pinned to one core as ``pdserve serve`` pins such a worker:

- prefill: a prompt of ``n`` random tokens in one step (``max_tokens`` 1); with a cached prefix,
  the prefix is sent first, and each timed prompt shares its first ``c`` tokens, which the engine
  must report cached (``Sequence.num_cached_tokens``); and ``k`` prompts of ``n`` tokens at once;
- decode: ``b`` sequences admitted with random KV of ``L`` tokens each by ``admit_kv`` (the decode
  worker's path: no prefill is computed for them), then pure decode steps of the whole batch;
- mixed: a fresh prompt beside ``d`` such decoding sequences of ``L`` tokens, in one step;
- hand-off: ``planner.handoff``, to a real decode worker on loopback (its ``--kv-transport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.codec import KvPayload
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.planner.budget import ServingPlan, calibrate, estimate_s, fit_budget, over_budget
from pdserve.planner.grid import Grid, Limits, batched_points, cached_points, decode_points, fit_grid, mixed_points
from pdserve.planner.handoff import measure_handoff
from pdserve.planner.machine import machine
from pdserve.planner.step_model import SCHEMA, StepModel, fit_profile
from pdserve.worker.cpus import pinned_thread, worker_cpu

TIMER = (
    "median of repeats of time.perf_counter() around LLMEngine.step(), spread over passes over all the step "
    "points (the hand-offs: over theirs), each pass of a point after warmup untimed runs"
)


def check_config(cfg: EngineConfig) -> None:
    """ValueError for engine settings under which the profile cannot build its steps."""
    if not cfg.enable_prefix_caching:
        raise ValueError("profile measures cached prefixes: drop --no-prefix-caching")
    if not cfg.enable_chunked_prefill:
        raise ValueError("profile measures mixed (chunked-prefill) steps: drop --no-chunked-prefill")
    if cfg.target_itl_ms is not None:
        raise ValueError("profile measures chunks of set sizes: drop --target-itl-ms")


def load_engine(cfg: EngineConfig) -> LLMEngine:
    """The engine for ``cfg``; ValueError naming the model when it cannot load."""
    try:
        return LLMEngine(cfg)
    except Exception as exc:  # a missing folder, a bad checkpoint, an unknown preset...
        raise ValueError(f"cannot load model {cfg.model!r}: {exc}") from exc


def limits(engine: LLMEngine) -> Limits:
    blocks, bs = engine.blocks.num_blocks, engine.cfg.block_size
    return Limits(engine.cfg.token_budget, engine.cfg.max_num_seqs, min(engine.max_model_len, blocks * bs), blocks, bs)


class Stepper:
    """Drives one engine for the measurements: random prompts and KV, timed steps."""

    def __init__(self, engine: LLMEngine, grid: Grid) -> None:
        self.engine, self.grid = engine, grid
        self.rng = random.Random(0)
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.engine.model_cfg.vocab_size) for _ in range(n)]

    def rid(self, kind: str) -> str:
        self.count += 1
        return f"profile-{kind}-{self.count}"

    def timed(self, one: Callable[[], float], repeats: int) -> list[float]:
        """The seconds of ``repeats`` calls of ``one`` (each returns its own time), after ``warmup``."""
        runs = [one() for _ in range(self.grid.warmup + repeats)]
        return runs[self.grid.warmup :]

    def step(self, expect: int) -> float:
        """Seconds of one engine step; RuntimeError unless ``expect`` sequences sampled a token."""
        t = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - t
        if len(outputs) != expect:
            raise RuntimeError(f"a measured step sampled {len(outputs)} tokens, expected {expect}")
        return seconds

    def prompts(self, prompts: list[list[int]], cached: int) -> float:
        """Seconds of the one step that prefills every prompt, whose first ``cached`` tokens each must
        come from the cache."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        seqs = [self.engine.add_request(self.rid("prefill"), ids, params) for ids in prompts]
        seconds = self.step(len(seqs))
        for seq in seqs:
            if seq.num_cached_tokens != cached or not seq.is_finished:
                raise RuntimeError(f"a prompt expected to reuse {cached} cached tokens reused {seq.num_cached_tokens}")
        return seconds

    def run_to_end(self, ids: list[int]) -> None:
        """Prefill ``ids`` (its full blocks enter the prefix cache), in as many steps as it takes."""
        self.engine.add_request(self.rid("prefix"), ids, SamplingParams(temperature=0.0, max_tokens=1))
        while self.engine.has_work():
            self.engine.step()

    def admit(self, b: int, context: int, max_tokens: int = 0) -> list[Sequence]:
        """``b`` decoding sequences of ``context`` tokens, admitted with random KV (a decode worker's
        path), each to produce ``max_tokens`` tokens (0: the grid's ``decode_margin``)."""
        e = self.engine
        mc = e.model_cfg
        kv = torch.randn(mc.num_layers, 2, context, mc.num_kv_heads, mc.head_dim, generator=self.gen)
        kv = kv.to(e.runner.dtype)
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens or self.grid.decode_margin, ignore_eos=True)
        sampling = sampling.to_dict()
        return [
            e.admit_kv(KvPayload(self.rid("decode"), e.fingerprint, self.ids(context), self.ids(1)[0], sampling, kv))
            for _ in range(b)
        ]

    def finish(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.engine.scheduler.finish(s)


def _point(samples: list[float], **fields) -> dict:
    return {**fields, "seconds": statistics.median(samples), "samples_s": samples}


@dataclass
class Section:
    """One kind of step point: its ``specs``; ``run(spec, repeats)``, that many timed seconds of
    one (after the warm-up); ``label(*spec)`` for progress; ``point(spec, samples)``, its JSON."""

    name: str
    specs: list[tuple]
    run: Callable[[tuple, int], list[float]]
    label: Callable[..., str]
    point: Callable[[tuple, list[float]], dict]


def measure_steps(st: Stepper, sections: list[Section], say: Callable[[str], None]) -> dict[str, list[dict]]:
    """Every section's points, their runs spread over the grid's passes: each pass measures every
    point of every section in turn, so a burst of other work on the machine, or a drift in its
    speed, touches one pass of each point and every section alike, not all the runs of one."""
    samples = {(sec.name, spec): [] for sec in sections for spec in sec.specs}
    passes = st.grid.pass_repeats()
    for k, reps in enumerate(passes, 1):
        for sec in sections:
            for spec in sec.specs:
                got = samples[(sec.name, spec)]
                got += sec.run(spec, reps)
                say(f"{sec.label(*spec)}   {statistics.median(got) * 1e3:9.2f} ms   pass {k}/{len(passes)}")
    return {sec.name: [sec.point(spec, samples[(sec.name, spec)]) for spec in sec.specs] for sec in sections}


def prefill_section(st: Stepper, lim: Limits) -> Section:
    """Steps of ``k`` prompts of ``n`` tokens after a cached prefix of ``c``: ``(k, n, c)``."""
    specs = [(1, n, 0) for n in st.grid.prefill_tokens] + [(1, n, c) for n, c in cached_points(st.grid, lim)]
    specs += [(k, n, 0) for k, n in batched_points(st.grid, lim)]
    prefixes = {c: st.ids(c) for _, _, c in specs}

    def run(spec: tuple, reps: int) -> list[float]:
        k, n, c = spec
        if c:
            st.run_to_end(prefixes[c])  # (back) in the prefix cache
        return st.timed(lambda: st.prompts([prefixes[c] + st.ids(n) for _ in range(k)], c), reps)

    return Section(
        "prefill",
        specs,
        run,
        lambda k, n, c: f"prefill  n={n:5d} c={c:5d} k={k:3d}",
        lambda spec, samples: _point(samples, prompts=spec[0], tokens=spec[1], cached_tokens=spec[2]),
    )


def decode_section(st: Stepper, lim: Limits, mixed: bool = False) -> Section:
    """Decode steps of ``decode_points``; with ``mixed``, steps of ``mixed_points``: a fresh prompt
    chunk beside the decoding sequences."""
    contexts: dict[tuple, list[int]] = {}

    def run(spec: tuple, reps: int) -> list[float]:
        p, b, context = spec if mixed else (0, *spec)
        seqs, totals = st.admit(b, context), []

        def one() -> float:
            totals.append(sum(s.num_tokens for s in seqs))  # positions the decode rows attend to
            if not p:
                return st.step(b)
            seq = st.engine.add_request(st.rid("mixed"), st.ids(p), SamplingParams(temperature=0.0, max_tokens=1))
            seconds = st.step(b + 1)
            if not seq.is_finished:
                raise RuntimeError(f"a {p}-token prompt beside {b} decoding sequences did not fit one step")
            return seconds

        samples = st.timed(one, reps)
        st.finish(seqs)
        contexts.setdefault(spec, []).extend(totals[-reps:])
        return samples

    def point(spec: tuple, samples: list[float]) -> dict:
        total = statistics.mean(contexts[spec])
        if mixed:
            return _point(samples, prompt_tokens=spec[0], cached_tokens=0, batch=spec[1], total_context=total)
        return _point(samples, batch=spec[0], context=total / spec[0], total_context=total)

    if mixed:
        specs, label = mixed_points(st.grid, lim), lambda p, d, n: f"mixed    p={p:5d} d={d:5d} L={n:5d}"
        return Section("mixed", specs, run, label, point)
    return Section("decode", decode_points(st.grid, lim), run, lambda b, n: f"decode   b={b:5d} L={n:5d}", point)


def run_profile(
    cfg: EngineConfig,
    grid: Grid,
    explicit: set[str] = frozenset(),
    say: Callable[[str], None] = lambda _: None,
    budget_s: float | None = None,
    serving: Callable[[StepModel, int], ServingPlan] | None = None,
) -> dict:
    """Measure every point of ``grid`` (cut to what the engine holds; ``explicit``: the grid
    fields the user set, see ``fit_grid``) and fit the model; returns the profile (schema
    ``SCHEMA``, layout in docs/cli.md). ``say`` gets one progress line per point. ``serving``
    builds the plan of the serving section that follows (from a step model and the longest prompt,
    tokens; planner/serving.py), for the estimate; the grid and that plan are cut to about
    ``budget_s`` seconds in all (planner/budget.py; None: no cut), the plan kept in the settings'
    ``serving_plan``.

    ValueError for settings the profile cannot use, a model that cannot load, or a grid the
    engine cannot hold; RuntimeError when the engine does not run a step as built."""
    check_config(cfg)
    start = time.perf_counter()
    engine = load_engine(cfg)
    worker_start_s = time.perf_counter() - start
    lim = limits(engine)
    grid, notes = fit_grid(grid, lim, explicit)
    for note in notes:
        say(f"skipped: {note}")
    st = Stepper(engine, grid)
    cpu = worker_cpu(cfg.device, cfg.torch_threads)  # pinned as pdserve serve pins a worker
    with pinned_thread([cpu]) if cpu is not None else contextlib.nullcontext():
        st.run_to_end(st.ids(min(64, lim.room - 1)))  # warms the kernels up
        rough = calibrate(st, lim, worker_start_s)
        plan = serving(rough.steps, engine.max_model_len - 2) if serving else None
        grid, plan, cuts = fit_budget(grid, lim, rough, budget_s, plan, explicit)
        for note in cuts:
            say(f"skipped: {note}")
        st.grid, notes = grid, notes + cuts
        estimate = time.perf_counter() - start + estimate_s(grid, lim, rough, plan)
        within = f" (--time-budget {budget_s:g} s{over_budget(estimate, budget_s, plan, rough)})" if budget_s else ""
        say(f"estimated {estimate / 60:.1f} min in all{within}")
        sections = [prefill_section(st, lim), decode_section(st, lim), decode_section(st, lim, mixed=True)]
        points = measure_steps(st, sections, say)
        points["handoff"], transport = asyncio.run(measure_handoff(engine, grid, lambda n: st.admit(1, n, 2)[0], say))
    settings = {
        "model_spec": cfg.model,
        "block_size": cfg.block_size,
        "kv_cache_blocks": lim.blocks,
        "max_model_len": engine.max_model_len,
        "max_num_batched_tokens": lim.budget,
        "max_num_seqs": lim.rows,
        "repeats": grid.repeats,
        "passes": len(grid.pass_repeats()),
        "warmup": grid.warmup,
        "timer": TIMER,
        "decode_batches": "admitted by LLMEngine.admit_kv with random KV (the decode worker's path)",
        "mixed_context_tokens": list(grid.mixed_contexts),
        "handoff_transport": transport,
        "pinned_cpu": cpu,
        "skipped": notes,
        "time_budget_s": budget_s,
        "estimated_s": estimate,
        "serving_plan": asdict(plan) if plan else None,
    }
    profile = {"schema": SCHEMA, "machine": machine(engine), "settings": settings, "points": points}
    profile["fits"] = fit_profile(points)
    profile["elapsed_s"] = time.perf_counter() - start
    return profile
