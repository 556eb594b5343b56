"""The serving path in the simulator: the profile's ``serving`` fit read back, its costs charged to
each step, token and request (``ServingModel``), the slowdown of workers sharing a machine's cores
with the router and the clients (``HostCpu``), and the serving probe's fit on known points."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.host_cpu import ROUTER_WINDOW_S, HostCpu, ServingModel
from pdserve.planner.serving import SERVING_UNITS, fit_serving
from pdserve.planner.simulate import SimConfig, Simulator
from pdserve.planner.step_model import StepModel
from tests.planner.test_simulate import toy_profile

SERVING = ServingModel(s0=0.002, s1=0.001, r0=0.003, r1=0.0005)


def with_serving(profile: dict, m: ServingModel) -> dict:
    coefs = {k: {"value": getattr(m, k), "unit": u} for k, u in SERVING_UNITS.items()}
    return {**profile, "fits": {**profile["fits"], "serving": {"coefficients": coefs}}}


def one_request(serving: ServingModel | None, placement: str = "colocated", n: int = 100, out: int = 4):
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
    host = HostCpu(2, SERVING)
    assert host.stretch(0.0, 2) == 1.0  # two workers on two cores
    assert host.stretch(0.0, 4) == pytest.approx(2.0)
    host.charge_router(1.0, 0.25)  # half a core of router work over the window
    assert host.router_load(1.0) == pytest.approx(0.25 / ROUTER_WINDOW_S)
    assert host.stretch(1.0, 2) == pytest.approx((2 + 0.5) / 2)
    assert host.stretch(1.0 + ROUTER_WINDOW_S + 0.01, 2) == 1.0  # the router's work has aged out
    assert HostCpu(0, SERVING).stretch(0.0, 100) == 1.0  # 0 cores: nothing shared
    with pytest.raises(ValueError, match="host cores"):
        HostCpu(-1, SERVING)


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


def test_the_probe_fit_recovers_known_costs():
    truth = ServingModel(s0=0.001, s1=5e-5, r0=0.002, r1=3e-4)
    points = []
    for b in (1, 4, 16, 32):
        for n in (16, 64):
            engine = n * 0.003 * (1 + b / 16)
            points.append(
                {
                    "batch": b,
                    "output_tokens": n,
                    "steps": n,
                    "wall_s": engine + n * truth.step_extra_s(b),
                    "engine_s": engine,
                    "router_cpu_s": truth.r0 * b + truth.r1 * b * n,
                }
            )
    fit = fit_serving(points)
    got = {k: c["value"] for k, c in fit["coefficients"].items()}
    for k, v in vars(truth).items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    assert fit["error"]["max_rel"] < 1e-6 and fit["router_cpu_error"]["max_rel"] < 1e-6
    with pytest.raises(ValueError, match="at least 2 points"):
        fit_serving(points[:1])


@pytest.mark.parametrize(
    "section, name, value, message",
    [
        ("handoff", "h1", 0, "coefficient h1 must be a number > 0"),
        ("prefill", "p0", -1, "coefficient p0 must be a number >= 0"),
        ("decode", "d1", float("nan"), "coefficient d1 must be a number >= 0"),
        ("serving", "r1", -5, "fits.serving.coefficients.r1 must be >= 0"),
        ("serving", "s0", float("nan"), "fits.serving.coefficients.s0 must be >= 0"),
    ],
)
def test_coefficients_that_no_machine_measures_are_refused(section, name, value, message):
    profile = with_serving(toy_profile(), SERVING)
    profile["fits"][section]["coefficients"][name]["value"] = value
    with pytest.raises(ValueError, match=message):
        StepModel.from_profile(profile)
        ServingModel.from_profile(profile)
