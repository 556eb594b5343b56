"""``pdserve profile --time-budget``: the estimate of a profile's time, and the grid cut to fit it
(planner/budget.py), on a made-up step model and through the CLI on the embedded model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from pdserve.planner.budget import KEEP, MIN_SAVING, Costs, ServingPlan, estimate_s, fit_budget, over_budget
from pdserve.planner.grid import DEFAULT, QUICK, Limits, fit_grid
from pdserve.planner.step_model import StepModel

from .test_profile import SMALL, run_cli

# A slow CPU: 1 ms a prompt token plus attention, 20 ms + 2 ms a sequence a decode step, 20 us to
# admit a token of KV, 2 s to load the engine.
SLOW = Costs(StepModel(0.01, 1e-3, 0.0, 1e-6, 0.02, 2e-3, 1e-6, 0.0, 0.0, 0.0, math.inf), 2e-5, 2.0)
LIM = Limits(budget=2048, rows=64, room=4096, blocks=4096, block_size=16)
PLAN = ServingPlan((1, 4, 16, 32), (16, 64), 16, (64, 256, 1024), 5, 0.2, 48, 256, (16, 64), (0.8, 0.8))


def full() -> tuple:
    grid, _ = fit_grid(DEFAULT, LIM)
    return grid, estimate_s(grid, LIM, SLOW, PLAN)


def test_no_budget_keeps_the_whole_grid():
    grid, _ = full()
    assert fit_budget(grid, LIM, SLOW, None, PLAN) == (grid, PLAN, [])


def test_a_budget_cuts_the_largest_values_until_the_estimate_fits():
    grid, whole = full()
    budget = whole / 2
    cut, plan, notes = fit_budget(grid, LIM, SLOW, budget, PLAN)
    assert estimate_s(cut, LIM, SLOW, plan) <= budget < whole
    assert notes and all("past --time-budget" in n for n in notes)
    assert "prompt steps of 2048 tokens: past --time-budget" in notes[0]  # the costliest point goes first
    for field in KEEP:  # only the largest values go: what is left is the start of each axis
        before, after = (getattr(x, field) for x in ((PLAN, plan) if field == "first_token_prompts" else (grid, cut)))
        assert after == before[: len(after)], field


def test_an_impossible_budget_stops_at_what_the_fits_need():
    grid, _ = full()
    cut, plan, notes = fit_budget(grid, LIM, SLOW, 1.0, PLAN)
    assert estimate_s(cut, LIM, SLOW, plan) > 1.0
    now = estimate_s(cut, LIM, SLOW, plan)
    for field, (keep, _) in KEEP.items():  # at what its fit needs, or its largest value saves too little
        owner = plan if field == "first_token_prompts" else cut
        values = getattr(owner, field)
        if len(values) > keep:
            less = replace(owner, **{field: values[:-1]})
            rest = estimate_s(cut, LIM, SLOW, less) if owner is plan else estimate_s(less, LIM, SLOW, plan)
            assert now - rest < MIN_SAVING, field
    assert len(cut.prefill_tokens) == KEEP["prefill_tokens"][0] and cut.batch_sizes[-1] < grid.batch_sizes[-1]
    assert cut.handoff_tokens == grid.handoff_tokens and len(notes) > 10


def test_values_worth_under_a_second_stay_and_a_missed_budget_says_why():
    """On a fast machine a tiny budget drops only what saves a share of it; what it still misses is
    said, with the serving section's share."""
    fast = Costs(StepModel(1e-5, 1e-7, 0.0, 0.0, 1e-5, 1e-7, 0.0, 0.0, 0.0, 0.0, math.inf), 1e-9, 0.1)
    grid, _ = fit_grid(DEFAULT, LIM)
    cut, plan, notes = fit_budget(grid, LIM, fast, 1.0, replace(PLAN, gap_s=0.0))
    assert cut == grid and notes == []  # every value costs far under MIN_SAVING of the budget
    assert over_budget(estimate_s(cut, LIM, fast, plan), 1.0, plan, fast).startswith(
        "; past the budget with every axis cut to what its fit needs; the serving section alone is about"
    )
    assert over_budget(0.5, 1.0, plan, fast) == "" and over_budget(5.0, None, plan, fast) == ""


def test_values_the_user_set_are_never_cut():
    grid, _ = full()
    cut, _, notes = fit_budget(grid, LIM, SLOW, 1.0, PLAN, explicit={"prefill_tokens", "batch_sizes"})
    assert cut.prefill_tokens == grid.prefill_tokens and cut.batch_sizes == grid.batch_sizes
    assert not any("prompt steps of" in n or "decode batches of" in n for n in notes)


def test_more_serving_work_is_estimated_longer():
    base = PLAN.seconds(SLOW)
    assert ServingPlan(**{**PLAN.__dict__, "load_requests": 96}).seconds(SLOW) > base
    assert ServingPlan(**{**PLAN.__dict__, "first_token_prompts": (64, 256)}).seconds(SLOW) < base
    assert ServingPlan.from_dict(json.loads(json.dumps(PLAN.__dict__))) == PLAN


def test_the_cli_records_the_budget_and_cuts_to_it(embedded_dir, tmp_path):
    """A 1 s budget on the quick grid: the axes the user left alone go down to what the fits need,
    the one they set stays whole, and the fits are still made."""
    path = tmp_path / "p.json"
    args = ["--quick", "--no-serving", "--time-budget", "1", "--context-lens", "32,64,128"]
    rc, out, err = run_cli("--model", str(embedded_dir), *SMALL, *args, "--out", str(path))
    assert rc == 0, err
    p = json.loads(path.read_text())
    s = p["settings"]
    assert s["time_budget_s"] == 1.0 and s["estimated_s"] > 1.0 and s["serving_plan"] is None
    assert "mixed steps' prompt chunks of 128 tokens: past --time-budget 1 s" in " ".join(s["skipped"])
    assert sorted({q["prompt_tokens"] for q in p["points"]["mixed"]}) == [QUICK.mixed_prompt_tokens[0]]
    contexts = sorted({q["context"] for q in p["points"]["decode"]})
    assert len(contexts) == 3 > KEEP["context_lens"][0]  # set by the user: kept whole
    assert "decode" in p["fits"] and "estimated " in out
    assert "min in all (--time-budget 1 s; past the budget with every axis cut to what its fit needs)" in out


def test_a_zero_budget_is_no_cut(embedded_dir, tmp_path):
    path = tmp_path / "p.json"
    args = ["--quick", "--no-serving", "--time-budget", "0", "--repeats", "1"]
    rc, _, err = run_cli("--model", str(embedded_dir), *SMALL, *args, "--out", str(path))
    assert rc == 0, err
    s = json.loads(path.read_text())["settings"]
    assert s["time_budget_s"] is None and s["skipped"] == []
