"""The serving path in the simulator: the profile's ``serving`` fits read back, their costs charged
to each step, token, request and first token on each path (``ServingModel``, ``ServingPaths``), the
slowdown of workers sharing a machine's cores with the router and the clients (``HostCpu``), and the
serving probe's fit on known points."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.host_cpu import ROUTER_WINDOW_S, HostCpu, ServingModel, ServingPaths
from pdserve.planner.serving_fit import SERVING_UNITS, fit_serving, predicted_engine_s
from pdserve.planner.simulate import SimConfig, Simulator
from pdserve.planner.step_model import StepModel
from tests.planner.test_load_factors import traced
from tests.planner.test_simulate import toy_profile

SERVING = ServingModel(s0=0.002, s1=0.001, r0=0.003, r1=0.0005)


def with_serving(profile: dict, m: ServingModel, section: str = "serving") -> dict:
    coefs = {k: {"value": getattr(m, k), "unit": u} for k, u in SERVING_UNITS.items() if getattr(m, k) is not None}
    return {**profile, "fits": {**profile["fits"], section: {"coefficients": coefs}}}


def one_request(serving: ServingModel | ServingPaths | None, placement: str = "colocated", n: int = 100, out: int = 4):
    model = StepModel.from_profile(toy_profile())
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    cfg = SimConfig(engine, placement, 1, 0 if placement == "colocated" else 1)
    spec = [RequestSpec(0, 1.0, tuple(range(3, 3 + n)), out, "random")]
    return model, Simulator(cfg, model, "float32", serving).run(spec)[0]


def test_the_serving_fit_is_read_back_and_its_absence_is_none():
    profile = toy_profile()
    assert ServingModel.from_profile(profile) is None  # a profile without the section: engine steps only
    assert ServingModel.from_profile(with_serving(profile, SERVING)) == SERVING
    broken = with_serving(profile, SERVING)
    del broken["fits"]["serving"]["coefficients"]["r1"]
    with pytest.raises(ValueError, match="fits.serving.coefficients.r1"):
        ServingModel.from_profile(broken)
    # a profile measured before the first-token points: no prefill factor, no first-token cost
    older = with_serving(profile, SERVING)
    for name in ("k_prefill", "f0"):
        del older["fits"]["serving"]["coefficients"][name]
    assert ServingModel.from_profile(older) == ServingModel(s0=0.002, s1=0.001, r0=0.003, r1=0.0005)
    # both paths: the split one where the profile has it, else the colocated one for both
    split = ServingModel(s0=0.001, r0=0.004, k_prefill=1.5, f0=0.002)
    assert ServingPaths.from_profile(with_serving(profile, SERVING)) == ServingPaths(SERVING, SERVING)
    both = with_serving(with_serving(profile, SERVING), split, "serving_split")
    assert ServingPaths.from_profile(both) == ServingPaths(SERVING, split)
    assert ServingPaths.from_profile(profile) is None
    served = with_serving(profile, SERVING)
    not_an_object = {**served, "fits": {**served["fits"], "serving_split": "oops"}}
    with pytest.raises(ValueError, match="no fits.serving_split.coefficients object"):
        ServingPaths.from_profile(not_an_object)


def test_each_step_token_and_request_pays_its_serving_cost():
    model, bare = one_request(None)
    _, served = one_request(SERVING)
    # TTFT: the router's time for the request, the prefill step and its serving cost, one relay
    first = model.prefill_s(100) + SERVING.step_extra_s(1)
    assert bare.ttft_s == pytest.approx(model.prefill_s(100))
    assert served.ttft_s == pytest.approx(SERVING.r0 + first + SERVING.r1)
    # every later token: its decode step plus the step's serving cost (one row)
    gaps = [b - a for a, b in zip(served.token_times_s, served.token_times_s[1:])]
    for i, gap in enumerate(gaps):
        assert gap == pytest.approx(model.decode_s(1, 101 + i) + SERVING.step_extra_s(1))
    assert served.sent_s == pytest.approx(1.0)  # measured from the client's send, not the worker's arrival


def test_no_rows_no_serving_cost():
    assert SERVING.step_extra_s(0) == 0.0
    assert SERVING.step_extra_s(8) == pytest.approx(0.002 + 8 * 0.001)


def test_shared_cores_stretch_steps_by_demand_over_cores():
    host = HostCpu(2)
    assert host.stretch(0.0, 2) == 1.0  # two workers on two cores
    assert host.stretch(0.0, 4) == pytest.approx(2.0)
    host.charge_router(1.0, 0.25)  # half a core of router work over the window
    assert host.router_load(1.0) == pytest.approx(0.25 / ROUTER_WINDOW_S)
    assert host.stretch(1.0, 2) == pytest.approx((2 + 0.5) / 2)
    assert host.stretch(1.0 + ROUTER_WINDOW_S + 0.01, 2) == 1.0  # the router's work has aged out
    assert HostCpu(0).stretch(0.0, 100) == 1.0  # 0 cores: nothing shared
    with pytest.raises(ValueError, match="host cores"):
        HostCpu(-1)


def test_colocated_workers_on_fewer_cores_run_slower():
    model = StepModel.from_profile(toy_profile())
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    specs = [RequestSpec(i, i * 0.01, tuple(range(3 + i, 67 + i)), 16, "random") for i in range(8)]

    def e2e(cores: float) -> float:
        recs = Simulator(SimConfig(engine, "colocated", 1, 1, host_cores=cores), model, "float32", SERVING).run(specs)
        return max(r.token_times_s[-1] for r in recs)

    alone, shared = e2e(0), e2e(1)
    assert shared > 1.5 * alone  # two busy workers and the router on one core: each step about twice as long
    assert e2e(4) == pytest.approx(alone)  # more cores than demand: no slowdown


def test_each_step_message_loads_the_shared_cores():
    model = StepModel.from_profile(toy_profile())
    engine = EngineConfig(model="embedded", max_num_batched_tokens=256)
    specs = [RequestSpec(i, i * 0.01, tuple(range(3 + i, 67 + i)), 16, "random") for i in range(8)]

    def e2e(serving: ServingModel, cores: float) -> float:
        recs = Simulator(SimConfig(engine, "colocated", 1, 1, host_cores=cores), model, "float32", serving).run(specs)
        return max(r.token_times_s[-1] for r in recs)

    heavy = dataclasses.replace(SERVING, rs=0.01)  # a router that spends 10 ms on each step's message
    assert e2e(heavy, 2) > 1.1 * e2e(SERVING, 2)  # two busy workers and that router on two cores
    assert e2e(heavy, 0) == pytest.approx(e2e(SERVING, 0))  # cores of their own: the router costs no step time


def test_the_probe_fit_recovers_known_costs():
    model = StepModel.from_profile(toy_profile())
    for placement in ("colocated", "split"):
        truth = ServingModel(s0=0.001, s1=5e-5, r0=0.002, r1=3e-4, rs=4e-4, k_prefill=1.3, f0=0.004)
        request_s = 0.0025  # the router admitting each request of a burst
        points = []
        for b in (1, 4, 16, 32):
            for n in (16, 64):
                q = {"batch": b, "output_tokens": n, "prompt_tokens": 16, "steps": n}
                # the worker's own engine counter is not what the fit reads: the model's prediction is
                wall = predicted_engine_s(model, q) + n * truth.step_extra_s(b) + request_s * b
                points.append(
                    {
                        **q,
                        "wall_s": wall,
                        "engine_s": 0.5 * wall,
                        "router_cpu_s": truth.r0 * b + truth.rs * n + truth.r1 * b * n,
                    }
                )
        fixed = truth.r0 + truth.r1 + (truth.step_extra_s(1) if placement == "colocated" else 0.0)
        first = [
            {"prompt_tokens": n, "ttft_s": fixed + truth.f0 + truth.k_prefill * model.prefill_s(n) + noise}
            for n in (64, 256, 1024)
            for noise in (0.0, 0.5, -0.5)  # the median of each length's runs is what counts
        ]
        # the load points: colocated workers' prompt and decode steps; a split pair's prefill worker's
        # prompt steps and its decode worker's decode steps
        steps = (
            {"colocated": traced(model, 1.25, 1.05)}
            if placement == "colocated"
            else {"prefill": traced(model, 1.4, 2.0), "decode": traced(model, 1.7, 0.95)}
        )
        # two halves of 20 requests, 16 and 64 tokens each: 5 ms of router + client CPU a request, 0.2 a token
        halves = [
            {"requests": 20, "output_tokens": 20 * n, "wall_s": 4.0, "router_cpu_s": 0.04, "client_cpu_s": cpu - 0.04}
            for n, cpu in ((16, 20 * (0.005 + 16 * 0.0002)), (64, 20 * (0.005 + 64 * 0.0002)))
        ]
        fit = fit_serving(points, first, model, placement, {"steps": steps, "rate_rps": 5.0, "halves": halves})
        got = {k: c["value"] for k, c in fit["coefficients"].items()}
        want = {**vars(truth), "k_prompt_load": 1.25, "k_decode_load": 1.05}
        want.update(cpu_request_load=0.005, cpu_token_load=0.0002)
        if placement == "split":
            want.update(k_prompt_load=1.4, k_decode_load=0.95)
        assert [h["router_cores"] for h in fit["load"]["halves"]] == pytest.approx([0.01, 0.01])
        assert fit["load"]["steps"]["decode" if placement == "split" else "colocated"]["decode"]["steps"] == 9
        assert set(got) == set(want), placement
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-6), (placement, k)
        assert fit["request_s"] == pytest.approx(request_s, rel=1e-6) and fit["placement"] == placement
        for err in ("error", "router_cpu_error", "first_token_error"):
            assert fit[err]["max_rel"] < 1e-6, err
    with pytest.raises(ValueError, match="at least 3 batch points"):
        fit_serving(points[:2], first, model, "colocated")
    with pytest.raises(ValueError, match="2 prompt lengths"):
        fit_serving(points, first[:3], model, "colocated")


def test_prefill_factor_and_first_token_cost_follow_the_request_path():
    colocated = ServingModel(s0=0.001, r0=0.002, r1=0.0003, k_prefill=1.2, f0=0.003, k_decode_load=1.1)
    split = ServingModel(s0=0.0005, r0=0.004, r1=0.0002, k_prefill=1.5, f0=0.006, k_decode_load=0.9)
    paths = ServingPaths(colocated, split)
    model, rec = one_request(paths, "colocated")
    # colocated: the router's time, the prefill step stretched by k_prefill, its step cost, the relay, f0
    first = colocated.r0 + colocated.k_prefill * model.prefill_s(100) + colocated.step_extra_s(1)
    assert rec.ttft_s == pytest.approx(first + colocated.r1 + colocated.f0)
    gaps = [b - a for a, b in zip(rec.token_times_s, rec.token_times_s[1:])]
    # decode: no k_prefill, no f0; the path's load factor
    assert gaps[1] == pytest.approx(model.decode_s(1, 102) * 1.1 + colocated.step_extra_s(1))
    # split: the prefill worker's step stretched by the split path's k_prefill, no step cost of its own
    model, rec = one_request(paths, "split")
    assert rec.ttft_s == pytest.approx(split.r0 + split.k_prefill * model.prefill_s(100) + split.r1 + split.f0)
    gaps = [b - a for a, b in zip(rec.token_times_s, rec.token_times_s[1:])]
    assert gaps[1] == pytest.approx(model.decode_s(1, 102) * 0.9 + split.step_extra_s(1))  # the decode worker's
    # the same costs as one model for both paths change the answer: the paths are really told apart
    _, same = one_request(ServingPaths(colocated, colocated), "split")
    assert same.ttft_s != pytest.approx(rec.ttft_s)


@pytest.mark.parametrize(
    "section, name, value, message",
    [
        ("handoff", "h1", 0, "coefficient h1 must be a number > 0"),
        ("prefill", "p0", -1, "coefficient p0 must be a number >= 0"),
        ("decode", "d1", float("nan"), "coefficient d1 must be a number >= 0"),
        ("serving", "r1", -5, "fits.serving.coefficients.r1 must be a number >= 0"),
        ("serving", "s0", float("nan"), "fits.serving.coefficients.s0 must be a number >= 0"),
        ("serving", "r0", True, "fits.serving.coefficients.r0 must be a number >= 0"),
        ("serving", "k_decode_load", 0, "k_decode_load is a ratio to the engine's: > 0, <= 100"),  # free steps
        ("serving", "k_decode_load", 1e300, "k_decode_load is a ratio to the engine's: > 0, <= 100"),
        ("serving", "k_prefill", 250, "k_prefill is a ratio to the engine's: >= 0, <= 100"),
    ],
)
def test_coefficients_that_no_machine_measures_are_refused(section, name, value, message):
    profile = with_serving(toy_profile(), SERVING)
    profile["fits"][section]["coefficients"][name]["value"] = value
    with pytest.raises(ValueError, match=message):
        StepModel.from_profile(profile)
        ServingModel.from_profile(profile)
    profile["fits"][section]["coefficients"][name] = 1.5  # a bare number where an object belongs
    with pytest.raises(ValueError, match=r"must be an object|no coefficient"):
        StepModel.from_profile(profile)
        ServingModel.from_profile(profile)
