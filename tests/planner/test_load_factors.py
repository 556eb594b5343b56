"""The simulator's step factors: a serving worker's steps under load against the profile's engine
(``k_prompt_load``, ``k_decode_load`` from the load points' traced steps, planner/serving_fit.py),
each role's and each kind of step's factor (``ServingPaths.step_factors``, ``StepFactors``), and the
workers the load points run (planner/serving_load.py)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.planner import virtual_runner
from pdserve.planner.host_cpu import ServingModel, ServingPaths
from pdserve.planner.serving_fit import MIN_LOAD_STEPS, step_ratios
from pdserve.planner.serving_load import LOAD_PREFILL_SHARE, LOAD_WORKERS, load_rate, load_roles
from pdserve.planner.simulate import SimConfig, Simulator
from pdserve.planner.step_model import StepModel
from pdserve.planner.virtual_runner import StepFactors
from tests.planner.test_simulate import toy_profile


def traced(model: StepModel, prompt: float, decode: float, n: int = 9) -> list[dict]:
    """Step-trace lines whose steps with a prompt chunk (alone or beside decode rows) took
    ``prompt`` x the model's prediction and decode-only steps ``decode`` x."""
    steps = []
    for i in range(n):
        b = i % 3  # 0: a prompt alone
        for chunks, rows, ratio in (([[256, 0]], b, prompt), ([], b + 1, decode)):
            predicted = model.batch_s([tuple(c) for c in chunks], rows, 300 * rows)
            line = {"t0": 10**9, "t1": 10**9 + round(predicted * ratio * 1e9), "cpu_ns": 0}
            steps.append({**line, "chunks": chunks, "b": rows, "context": 300 * rows})
    return steps


def test_load_factors_come_from_enough_traced_steps_of_their_kind():
    model = StepModel.from_profile(toy_profile())
    ratios = step_ratios(traced(model, 1.25, 1.05), model)
    assert ratios["prompt"]["steps"] == ratios["decode"]["steps"] == 9
    assert ratios["prompt"]["median"] == pytest.approx(1.25, rel=1e-6)
    assert ratios["decode"]["p10"] == pytest.approx(1.05, rel=1e-6) == ratios["decode"]["p90"]
    few = step_ratios(traced(model, 1.25, 1.05, n=MIN_LOAD_STEPS - 1), model)
    assert few == {"prompt": None, "decode": None}  # too few to judge: no factor, the engine's own time


def test_step_factors_follow_the_worker_role():
    colocated = ServingModel(k_prefill=1.2, k_prompt_load=1.4, k_decode_load=1.1)
    split = ServingModel(k_prefill=1.5, k_prompt_load=1.6, k_decode_load=0.9)
    paths = ServingPaths(colocated, split)
    assert paths.step_factors("prefill") == StepFactors(lone=1.5, loaded=1.6, decode=0.9)
    assert paths.step_factors("colocated") == StepFactors(lone=1.2, loaded=1.4, decode=1.1)
    # a decode worker decodes at the split path's pace and prefills its own prompts as a colocated worker
    assert paths.step_factors("decode") == StepFactors(lone=1.2, loaded=1.4, decode=0.9)
    # with no prefill worker left, decode workers prefill their own prompts: colocated workers' decode steps
    assert paths.step_factors("decode", local=True) == StepFactors(lone=1.2, loaded=1.4, decode=1.1)
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    sim = Simulator(SimConfig(engine, "auto", 1, 1), StepModel.from_profile(toy_profile()), "float32", paths)
    assert [w.engine.runner.factors.decode for w in sim.workers] == [0.9, 0.9]  # split: the split path's
    sim.set_role(sim.workers[0], "decode")  # the prefill worker switches: both decode and prefill locally
    assert [w.engine.runner.factors.decode for w in sim.workers] == [1.1, 1.1]
    # the router's and clients' CPU: the load points' figure a token when measured, else the light probe's
    light = ServingModel(r0=0.002, rs=0.0004, r1=0.0001)
    assert light.cpu_s == (0.002, 0.0004, 0.0001)
    assert dataclasses.replace(light, cpu_request_load=0.003, cpu_token_load=0.0005).cpu_s == (0.003, 0.0, 0.0005)
    # a profile without load points: prompts take k_prefill under load too, decode steps the engine's time
    old = ServingPaths(ServingModel(k_prefill=1.2), ServingModel(k_prefill=1.5))
    assert old.step_factors("prefill") == StepFactors(lone=1.5, loaded=1.5, decode=1.0)
    assert old.step_factors("decode") == StepFactors(lone=1.2, loaded=1.2, decode=1.0)


@pytest.mark.parametrize(
    "chunks, rows, neighbours, factor",
    [
        ([(100, 0)], 0, False, "lone"),
        ([(100, 0)], 0, True, "loaded"),  # another worker on the machine computes
        ([(100, 0)], 2, False, "loaded"),  # beside decode rows
        ([], 2, False, "decode"),
        ([], 2, True, "decode"),
    ],
)
def test_the_virtual_runner_stretches_each_kind_of_step_by_its_factor(monkeypatch, chunks, rows, neighbours, factor):
    model = StepModel.from_profile(toy_profile())
    sim = Simulator(
        SimConfig(EngineConfig(model="embedded", max_num_batched_tokens=256), "colocated", 1, 0), model, "float32"
    )
    runner = sim.workers[0].engine.runner
    runner.factors, runner.neighbours_busy = StepFactors(lone=1.5, loaded=2.0, decode=3.0), neighbours
    monkeypatch.setattr(virtual_runner, "batch_shape", lambda batch: (chunks, rows, 300))
    start = runner.clock.now_s
    runner.run(SimpleNamespace(seqs=[], num_query_tokens=[]))
    want = model.batch_s(chunks, rows, 300) * getattr(runner.factors, factor)
    assert runner.clock.now_s - start == pytest.approx(want)


def test_the_load_runs_a_colocated_worker_per_core_and_a_split_pair():
    cpu = EngineConfig(model="embedded", torch_threads=1)
    assert load_roles("split", cpu) == ("prefill", "decode")
    cores = os.cpu_count() or 1
    assert load_roles("colocated", cpu) == ("colocated",) * max(1, min(LOAD_WORKERS, cores))
    assert load_roles("colocated", dataclasses.replace(cpu, torch_threads=cores)) == ("colocated",)
    assert load_roles("colocated", dataclasses.replace(cpu, device="cuda")) == ("colocated",)  # one GPU's


def test_a_split_pair_meets_the_rate_of_two_colocated_workers():
    """Both placements of two workers take the same load; the split pair's one prefill worker is
    then busy twice the share a colocated worker is."""
    split, colocated = load_rate(("prefill", "decode"), 0.8), load_rate(("colocated",) * 2, 0.8)
    assert split == colocated == pytest.approx(2 * LOAD_PREFILL_SHARE / 0.8)
    assert split * 0.8 == pytest.approx(2 * LOAD_PREFILL_SHARE)  # the prefill worker's busy share
    assert load_rate(("colocated",) * 4, 0.8) == pytest.approx(2 * colocated)
    with pytest.raises(ValueError, match="prefill time"):
        load_rate(("colocated",), 0.0)
