"""The default token budget against a step target, through the simulator (the real scheduler on a
virtual clock): on a slow core, where a 200 ms step holds only a few dozen prompt tokens beside the
decode rows, cutting every prompt to that target costs a colocated worker most of its prefill
throughput near capacity; the default 2,048-token budget keeps it, and TPOT still holds."""

from __future__ import annotations

import json

from tests.planner.test_plan import fit
from tests.planner.test_simulate import run_cli, toy_profile


def slow_core_profile() -> dict:
    """40 ms a step (the weights), 3.5 ms a prompt token, 3 ms a decode row: an AVX2 core in float32."""
    p = toy_profile()
    p["fits"]["prefill"] = fit(p0=0.04, p1=0.0035, p2=0.0, p3=0.0)
    p["fits"]["decode"] = fit(d0=0.04, d1=0.003, d2=0.0)
    p["fits"]["mixed"] = fit(m1=0.003, m2=0.0)
    p["fits"]["handoff"] = fit(h0=0.001, h1=1e9)
    return p


def simulate(tmp_path, name: str, *extra: str) -> dict:
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(slow_core_profile()))
    out = tmp_path / name
    code, _, err = run_cli(
        "simulate", "--profile", str(prof), "--placement", "colocated", "--prefill", "1", "--decode", "1",
        "--prompts", "random", "--arrival", "poisson", "--input-len", "256", "--output-len", "64", "--rate", "1.0",
        "--num-requests", "60", "--slo-ttft-ms", "1400", "--slo-tpot-ms", "140", "--out", str(out), *extra,
    )  # fmt: skip
    assert code == 0, err
    return json.loads((out / "summary.json").read_text())


def test_the_default_budget_keeps_the_prefill_throughput_a_step_target_loses(tmp_path):
    default, target = simulate(tmp_path, "default"), simulate(tmp_path, "target", "--target-itl-ms", "200")
    assert default["completed"] == target["completed"] == 60
    # the target cuts each 256-token prompt into several chunks, each paying the decode rows again
    assert target["ttft_p50_s"] > 1.2 and default["ttft_p50_s"] < 1.1
    assert default["goodput_rps"] > 1.5 * target["goodput_rps"]
    assert default["tpot_p90_s"] < 0.140  # whole prompts still leave TPOT within the SLO
