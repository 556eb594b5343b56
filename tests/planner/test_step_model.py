"""The step-time model without timing noise: fits of points made from known coefficients, the
profile checks of ``StepModel.from_profile``, and how the grid is cut to an engine's limits."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest

from pdserve.planner.grid import DEFAULT, QUICK, Limits, batched_points, decode_points, fit_grid, mixed_points
from pdserve.planner.step_model import SCHEMA, SECTIONS, UNITS, StepModel, fit_profile, nnls

# Decode rows in a mixed step cost more than in a decode step (m1 > d1, m2 > d2), as measured on CPU.
TRUE = StepModel(
    p0=4e-3, p1=40e-6, p2=400e-9, p3=5e-9, d0=4e-3, d1=100e-6, d2=80e-9, m1=150e-6, m2=200e-9, h0=5e-3, h1=2e9
)
NAMES = ("p0", "p1", "p2", "p3", "d0", "d1", "d2", "m1", "m2", "h0", "h1")


def synthetic_points(model: StepModel) -> dict:
    """Points whose times are exactly ``model``'s predictions: single prompts with and without a
    cached prefix, steps of several prompts, mixed steps at two decode contexts."""
    prefill = [{"prompts": 1, "tokens": n, "cached_tokens": c} for n in (16, 64, 256, 1024) for c in (0, 512)]
    prefill += [{"prompts": k, "tokens": n, "cached_tokens": 0} for k, n in ((4, 16), (16, 64), (8, 256))]
    decode = [{"batch": b, "total_context": b * n} for b in (1, 8, 64) for n in (64, 1024)]
    mixed = [
        {"prompt_tokens": p, "cached_tokens": 0, "batch": d, "total_context": d * n}
        for p in (64, 512)
        for d in (1, 8, 32)
        for n in (256, 1024)
    ]
    handoff = [{"tokens": n, "bytes": n * 2048} for n in (16, 256, 4096)]
    for q in prefill:
        q["seconds"] = model.batch_s([(q["tokens"], q["cached_tokens"])] * q["prompts"], 0, 0)
    for q in decode:
        q["seconds"] = model.decode_s(q["batch"], q["total_context"])
    for q in mixed:
        q["seconds"] = model.mixed_s(q["prompt_tokens"], 0, q["batch"], q["total_context"])
    for q in handoff:
        q["seconds"] = model.handoff_s(q["bytes"])
    return {"prefill": prefill, "decode": decode, "mixed": mixed, "handoff": handoff}


def profile_of(points: dict) -> dict:
    return {"schema": SCHEMA, "machine": {}, "settings": {}, "points": points, "fits": fit_profile(points)}


def test_a_fit_of_exact_points_recovers_the_coefficients_and_reports_no_error():
    profile = profile_of(synthetic_points(TRUE))
    fitted = StepModel.from_profile(profile)
    for name in NAMES:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    for section in SECTIONS:
        fit = profile["fits"][section]
        assert set(fit) == {"formula", "coefficients", "error"}
        assert {k: c["unit"] for k, c in fit["coefficients"].items()} == UNITS[section]
        assert fit["error"]["max_rel"] < 1e-6 and fit["error"]["median_rel"] <= fit["error"]["max_rel"]
        assert fit["error"]["points"] == len(profile["points"][section])


def test_errors_are_relative_to_each_measured_point():
    points = synthetic_points(TRUE)
    points["handoff"][0]["seconds"] *= 2  # one point measured twice as long as the others say
    err = fit_profile(points)["handoff"]["error"]
    model = StepModel.from_profile(profile_of(points))
    rel = [abs(model.handoff_s(q["bytes"]) - q["seconds"]) / q["seconds"] for q in points["handoff"]]
    assert err["max_rel"] == pytest.approx(max(rel)) and err["median_rel"] == pytest.approx(float(np.median(rel)))


def test_nnls_keeps_every_coefficient_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falls with the second column: its best unconstrained slope is -1
    x = nnls(a, y)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_a_mixed_step_is_a_prefill_step_whose_decode_rows_cost_m1_and_m2():
    m = TRUE
    assert m.mixed_s(256, 64, 8, 2048) == pytest.approx(m.prefill_s(256, 64) + 8 * m.m1 + 2048 * m.m2)
    assert m.mixed_s(256, 64, 0, 0) == m.prefill_s(256, 64)
    assert m.mixed_s(0, 0, 8, 2048) == m.decode_s(8, 2048)
    two = m.batch_s([(100, 0), (28, 300)], 8, 2048)  # p0 once; p1, p3 on all 128 tokens; attention of each
    pre = m.p0 + m.p1 * 128 + m.p2 * (100 * 50 + 28 * (14 + 300)) + m.p3 * 128**2
    assert two == pytest.approx(pre + 8 * m.m1 + 2048 * m.m2)
    # the old rule (the parts' sum less one per-step cost) is short by the decode rows' extra cost
    old = m.prefill_s(64) + m.decode_s(32, 32 * 1024) - min(m.p0, m.d0)
    assert m.mixed_s(64, 0, 32, 32 * 1024) > 1.2 * old


def test_a_fit_recovers_mixed_rows_that_cost_more_than_decode_rows_and_falls_back_without_points():
    points = synthetic_points(TRUE)
    fitted = {k: c["value"] for k, c in fit_profile(points)["mixed"]["coefficients"].items()}
    assert fitted == pytest.approx({"m1": TRUE.m1, "m2": TRUE.m2}, rel=1e-6)
    noisy = synthetic_points(TRUE)
    for i, q in enumerate(noisy["mixed"]):
        q["seconds"] *= 1.02 if i % 2 else 0.98
    m = StepModel.from_profile(profile_of(noisy))  # 2 % off each way: close, also past the points
    assert profile_of(noisy)["fits"]["mixed"]["error"]["max_rel"] < 0.05
    assert m.mixed_s(64, 0, 63, 63 * 2000) == pytest.approx(TRUE.mixed_s(64, 0, 63, 63 * 2000), rel=0.1)
    points["mixed"] = points["mixed"][:1]  # one point cannot tell m1 from m2: a decode step's costs
    m = StepModel.from_profile(profile_of(points))
    assert (m.m1, m.m2) == pytest.approx((TRUE.d1, TRUE.d2))


def test_a_fit_tells_the_step_size_term_from_attention_by_batched_and_cached_prompts():
    fitted = StepModel.from_profile(profile_of(synthetic_points(TRUE)))
    assert (fitted.p2, fitted.p3) == pytest.approx((TRUE.p2, TRUE.p3), rel=1e-6)
    single = synthetic_points(replace(TRUE, p3=0.0))  # no rise per token with the step's size
    assert StepModel.from_profile(profile_of(single)).p3 == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("model", [TRUE, replace(TRUE, p0=1e-3, m1=10e-6, m2=10e-9)])
def test_more_work_is_never_predicted_faster(model):
    """Every argument, and a prompt joining decode rows even when a prefill step's costs are the
    smaller (``p0 < d0``, ``m1 < d1``): the step never falls below the rows' decode step."""
    m = model
    sizes = [0, 1, 16, 128, 1024, 2048]
    for a, b in zip(sizes, sizes[1:]):
        assert m.prefill_s(a) <= m.prefill_s(b) and m.prefill_s(64, a) <= m.prefill_s(64, b)
        assert m.mixed_s(a, 0, 4, 512) <= m.mixed_s(b, 0, 4, 512) <= m.mixed_s(b, 0, 8, 1024)
        assert m.mixed_s(64, a, 4, 512) <= m.mixed_s(64, b, 4, 512)
        assert m.batch_s([(16, 0)] * (a + 1), 2, 64) <= m.batch_s([(16, 0)] * (b + 1), 2, 64)
        assert m.mixed_s(64, 0, a, 64 * a) <= m.mixed_s(64, 0, b, 64 * b)


def test_the_flat_handoff_has_no_cost_per_byte():
    points = synthetic_points(TRUE)
    for q, seconds in zip(points["handoff"], (5e-3, 5e-3, 4.9e-3)):  # no cost per byte to be seen
        q["seconds"] = seconds
    flat = profile_of(points)
    assert flat["fits"]["handoff"]["coefficients"]["h1"]["value"] is None  # JSON has no infinity
    model = StepModel.from_profile(flat)
    assert model.h1 == math.inf and model.handoff_s(1e9) == model.handoff_s(0) == pytest.approx(5e-3, rel=0.02)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda p: p.update(schema=SCHEMA + 1), f"profile schema {SCHEMA + 1}; this pdserve reads schema {SCHEMA}"),
        (lambda p: p.update(schema=1), "profile schema 1; this pdserve reads schema 2 (run pdserve profile again"),
        (lambda p: p.pop("schema"), "profile schema None"),
        (lambda p: p.pop("machine"), "profile has no 'machine' section"),
        (lambda p: p["fits"].pop("decode"), "profile has no fits.decode section"),
        (lambda p: p["fits"]["handoff"]["coefficients"].pop("h1"), "no coefficient fits.handoff.coefficients.h1"),
        (lambda p: p["fits"]["mixed"]["coefficients"].pop("m2"), "no coefficient fits.mixed.coefficients.m2"),
    ],
)
def test_from_profile_refuses_another_schema_or_a_missing_section(edit, needle):
    profile = copy.deepcopy(profile_of(synthetic_points(TRUE)))
    edit(profile)
    with pytest.raises(ValueError) as info:
        StepModel.from_profile(profile)
    assert needle in str(info.value)
    with pytest.raises(ValueError, match="a profile is a JSON object"):
        StepModel.from_profile([])


SMALL = Limits(budget=2048, rows=64, room=2048, blocks=16384, block_size=16)


def test_the_default_grid_is_cut_to_the_context_window_with_its_edge_measured():
    g, notes = fit_grid(DEFAULT, SMALL)
    assert g.prefill_tokens == (16, 32, 64, 128, 256, 512, 1024, 2047)  # prompt + its first token fit 2048
    assert g.context_lens == (64, 256, 1024, 2048 - DEFAULT.decode_margin)
    assert g.handoff_tokens[-1] == 2046 and notes == []
    mixed = mixed_points(g, SMALL)
    assert {n for _, _, n in mixed} == {256, 1024} and len(mixed) == 18
    assert all(1 <= d < SMALL.rows and p + d <= SMALL.budget for p, d, _ in mixed)
    assert batched_points(g, SMALL) == [(4, 16), (4, 64), (4, 128), (16, 16), (16, 64), (16, 128)]


def test_combinations_past_the_kv_cache_are_skipped_with_a_note():
    lim = Limits(budget=2048, rows=64, room=2048, blocks=512, block_size=16)  # 8192 token slots
    g, notes = fit_grid(DEFAULT, lim)
    held = decode_points(g, lim)
    assert (64, 1024) not in held and (1, 1024) in held
    assert "decode batch 64 x 1024 tokens: more KV than the cache holds (raise --kv-cache-gib)" in notes
    assert all(b * lim.blocks_for(n + g.decode_margin) <= lim.blocks for b, n in held)


@pytest.mark.parametrize(
    "field,values,needle",
    [
        ("prefill_tokens", (16, 4096), "--prefill-tokens 4096: a prompt step holds"),
        ("batch_sizes", (1, 128), "--batch-sizes 128: a step holds at most --max-num-seqs sequences, at most 64 here"),
        ("context_lens", (64, 9000), "--context-lens 9000: a decoding sequence"),
        ("cached_tokens", (100,), "--cached-tokens 100: a cached prefix is whole KV blocks of 16 tokens"),
        ("cached_tokens", (4096,), "--cached-tokens 4096: at most"),
    ],
)
def test_a_grid_value_the_engine_cannot_hold_is_an_error(field, values, needle):
    from dataclasses import replace

    with pytest.raises(ValueError) as info:
        fit_grid(replace(QUICK, **{field: values}), SMALL, {field})
    assert needle in str(info.value)


def test_too_few_points_left_to_fit_is_an_error():
    tiny = Limits(budget=2048, rows=1, room=2048, blocks=16384, block_size=16)  # one sequence a step
    with pytest.raises(ValueError, match="fewer than 3 decode points"):
        fit_grid(QUICK, tiny)


def test_mixed_steps_that_cannot_run_as_one_step_are_skipped_with_a_note():
    two_rows = Limits(budget=2048, rows=2, room=2048, blocks=16384, block_size=16)  # the prompt keeps one row
    g, notes = fit_grid(QUICK, two_rows)
    assert g.batch_sizes == (1, 2) and mixed_points(g, two_rows) == [] and batched_points(g, two_rows) == []
    text = " ".join(notes)
    assert "mixed step of 32 prompt tokens beside 2 sequences of 128 tokens: past the step's token budget, " in text
    assert "step of 4 prompts of 16 tokens: past the step's token budget, --max-num-seqs or the KV cache" in text


def test_a_decode_context_past_the_window_is_measured_at_the_window():
    short = Limits(budget=2048, rows=64, room=512, blocks=16384, block_size=16)
    g, notes = fit_grid(DEFAULT, short)
    assert g.mixed_contexts == (256, 512 - DEFAULT.decode_margin)
    assert {n for _, _, n in mixed_points(g, short)} == set(g.mixed_contexts)
