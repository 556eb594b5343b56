"""``pdserve plan``: the search never proposes a placement lacking a role, one worker gives
colocated, the ratio follows the slower phase, bad inputs exit 2, plan.json holds every candidate."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.main import main
from pdserve.engine.config import EngineConfig
from pdserve.loadgen import metrics
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.plan import Planner, candidates, ratios, scaled
from pdserve.planner.step_model import StepModel
from tests.planner.test_simulate import run_cli, toy_profile

WORKLOAD = ["--arrival", "poisson", "--prompts", "random", "--num-requests", "12", "--input-len", "64"]
WORKLOAD += ["--output-len", "16", "--max-num-seqs", "16", "--local-prefill-tokens", "0", "--search-steps", "3"]


def fit(**values):
    return {"coefficients": {k: {"value": v, "unit": "s"} for k, v in values.items()}}


def profile(prefill_s: float, decode_s: float) -> dict:
    """A free hand-off; prefill takes ``prefill_s`` a prompt token, decode ``decode_s`` a row."""
    p = toy_profile()
    p["fits"]["prefill"] = fit(p0=1e-3, p1=prefill_s, p2=0.0, p3=0.0)
    p["fits"]["decode"] = fit(d0=1e-3, d1=decode_s, d2=0.0)
    p["fits"]["mixed"] = fit(m1=decode_s, m2=0.0)  # a decode row beside a prompt costs as in a decode step
    p["fits"]["handoff"] = fit(h0=0.0, h1=1e15)
    return p


def plan(tmp_path, prof: dict, workers: str, *extra: str) -> tuple[int, str, str, dict | None]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(
        "plan", "--profile", str(path), "--workers", workers, "--out", str(out), *WORKLOAD, *extra
    )
    doc = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else None
    return code, stdout, stderr, doc


SLO = ["--slo-ttft-ms", "400", "--slo-tpot-ms", "60"]


def test_ratios_and_candidates_have_every_role():
    assert ratios(4) == [(1, 1), (2, 1), (1, 2), (3, 1), (1, 3)]
    assert [c.placement for c in candidates(1)] == ["colocated", "colocated"]
    assert all(c.num_prefill >= 1 and c.num_decode >= 1 for c in candidates(1000) if c.placement == "split")
    assert max(c.unit for c in candidates(1000, max_unit=8)) == 8


def test_one_worker_is_colocated(tmp_path):
    code, out, _, doc = plan(tmp_path, profile(1e-4, 1e-4), "1", *SLO)
    assert code == 0 and doc["best"]["placement"] == "colocated" and doc["best"]["workers"] == {"colocated": 1}
    assert "best: colocated" in out


def ratio_of(doc: dict) -> tuple[int, int]:
    splits = [c for c in doc["candidates"] if c["placement"] == "split"]
    best = max(splits, key=lambda c: c["goodput_per_worker_rps"])
    return best["num_prefill"], best["num_decode"]


def test_slow_prefill_wants_more_prefill_workers(tmp_path):
    code, _, _, doc = plan(tmp_path, profile(2e-3, 1e-4), "12", *SLO, "--max-unit", "3")
    assert code == 0
    gp = {(c["num_prefill"], c["num_decode"]): c["goodput_per_worker_rps"] for c in doc["candidates"] if c["unit"] > 1}
    assert gp[(2, 1)] > gp[(1, 1)] > gp[(1, 2)]
    assert ratio_of(doc) == (2, 1)
    best = doc["best"]
    assert all(v >= 1 for v in best["workers"].values())
    assert len(doc["candidates"]) == 4  # colocated, 1:1, 2:1, 1:2: every one with its figures
    for c in doc["candidates"]:
        assert {"max_rate_rps", "goodput_per_worker_rps", "slo_attainment", "ttft_p90_ms", "tpot_p50_ms"} <= set(c)


def test_slow_decode_wants_more_decode_workers(tmp_path):
    code, _, _, doc = plan(tmp_path, profile(1e-5, 3e-3), "12", "--slo-ttft-ms", "400", "--slo-tpot-ms", "40",
                           "--max-unit", "3")  # fmt: skip
    assert code == 0
    gp = {(c["num_prefill"], c["num_decode"]): c["goodput_per_worker_rps"] for c in doc["candidates"] if c["unit"] > 1}
    assert gp[(1, 2)] > gp[(1, 1)] and ratio_of(doc) == (1, 2)


@pytest.mark.parametrize(
    "workers, extra, needle",
    [
        ("0", SLO, "--workers must be at least 1"),
        ("4", ["--slo-ttft-ms", "100"], "--slo-tpot-ms"),
        ("4", [], "plan needs an SLO"),
        ("4", [*SLO, "--max-model-len", "32"], ""),
        ("4", [*SLO, "--max-probe-requests", "5"], "--max-probe-requests 5 is below --num-requests"),
    ],
)
def test_bad_inputs_exit_2(tmp_path, workers, extra, needle):
    code, _, err, _ = plan(tmp_path, profile(1e-4, 1e-4), workers, *extra)
    assert code == 2 and err.startswith("error:") and needle in err and err.count("\n") == 1


def test_bad_profile_exits_2(tmp_path):
    p = profile(1e-4, 1e-4)
    del p["fits"]["decode"]
    code, _, err, _ = plan(tmp_path, p, "4", *SLO)
    assert code == 2 and err.startswith("error:")


def test_a_synthetic_workload_probes_distinct_prompts(tmp_path):
    code, out, _, doc = plan(tmp_path, profile(1e-4, 1e-4), "2", *SLO, "--max-probe-requests", "40")
    assert code == 0 and doc["requests_per_probe"] == [12, 40] and "with 12-40 requests a probe" in out
    specs = [RequestSpec(i, float(i), (3 + i,) * 8, 16, "random") for i in range(40)]  # what plan builds: 40
    planner = Planner(EngineConfig(model="embedded"), StepModel.from_profile(toy_profile()), "float32",
                      metrics.SLO(0.4, 0.06), max_requests=40, min_requests=12)  # fmt: skip
    assert planner.count(specs, 0.01) == 12  # a slow probe: the workload's own count
    for rate in (0.5, 5, 50, 5000):  # a fast one: up to the cap, and never a prompt twice
        n = planner.count(specs, rate)
        probe = scaled(specs, rate, n)
        assert 12 <= n <= 40 and len({s.prompt_token_ids for s in probe}) == n
        assert [s.send_at_s for s in probe] == [s.send_at_s / rate for s in specs[:n]]


def test_max_num_seqs_below_1_is_refused_by_its_flag(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile(1e-4, 1e-4)))
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--profile", str(path), "--workers", "2", *SLO, "--max-num-seqs", "0,16"])
    assert exc.value.code == 2
    assert "--max-num-seqs: need one or more integers >= 1: '0,16'" in capsys.readouterr().err


def test_an_slo_no_placement_meets_says_so(tmp_path):
    code, out, _, doc = plan(tmp_path, profile(1e-4, 1e-4), "2", "--slo-ttft-ms", "0.001", "--slo-tpot-ms", "0.001")
    assert code == 0 and doc["best"]["goodput_per_worker_rps"] == 0
    assert "best: none: no placement meets the SLO for 90% of requests" in out and "predicted goodput" not in out
    assert "nan" not in out  # no request met a rate: its latency cells read "-"


def test_a_rate_found_at_the_search_ceiling_or_with_capped_probes_is_flagged(tmp_path):
    # steps of ~1 ms: every rate the search doubles to meets the SLO with 40-request probes
    code, out, _, doc = plan(tmp_path, profile(1e-8, 1e-8), "2", *SLO, "--max-probe-requests", "40")
    best = doc["best"]
    assert code == 0 and best["search_ceiling"] and best["probe_capped"]
    assert "its rate is the search's ceiling, not the placement's limit" in out
    tied = [r for r in doc["candidates"][1:] if r["search_ceiling"]]  # the others met every rate too
    assert tied and f"so did {len(tied)} other" in out and "raise the top of --rates to separate them" in out
    assert "a probe of 40 requests (--max-probe-requests) ends before a queue can build" in out


def test_a_rate_found_below_the_ceiling_with_full_probes_is_not_flagged(tmp_path):
    # prefill of 2 ms a token: a 64-token prompt takes 128 ms, so a unit saturates near 8 req/s,
    # where a probe spans 2 x (0.4 + 0.06 x 16) s x 8 req/s = 22 requests, under the cap
    code, out, _, doc = plan(tmp_path, profile(2e-3, 1e-4), "1", *SLO, "--max-probe-requests", "100")
    best = doc["best"]
    assert code == 0 and best["goodput_per_worker_rps"] > 0
    assert not best["search_ceiling"] and not best["probe_capped"] and "warning:" not in out
    specs = [RequestSpec(i, float(i), (3 + i,) * 8, 16, "random") for i in range(40)]
    planner = Planner(EngineConfig(model="embedded"), StepModel.from_profile(toy_profile()), "float32",
                      metrics.SLO(0.4, 0.06), max_requests=40)  # fmt: skip
    assert not planner.capped(specs, 14.0) and planner.capped(specs, 15.0)  # 2 x 1.36 s x 15 = 40.8 > 40
