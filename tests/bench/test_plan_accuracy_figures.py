"""benchmarks/plan_accuracy_figures.py: the placements the accuracy benchmark takes, the relative error
of a predicted figure, which rows count as saturated and whether a row meets the 10 % target. The
benchmark itself is never run here."""

from __future__ import annotations

import math

import pytest

from tests.bench._scripts import load_script

F = load_script("plan_accuracy_figures")


def test_placements_parse_to_serve_flags():
    colocated, split, auto = F.parse_placements("colocated:2, split:1+1,auto:3")
    assert colocated.flags() == ["--placement", "colocated", "--prefill", "1", "--decode", "1"]
    assert split.flags() == ["--placement", "split", "--prefill", "1", "--decode", "1"]
    assert (auto.kind, auto.prefill, auto.decode, auto.text) == ("auto", 2, 1, "auto:3")
    for bad in ("colocated", "split:1+x", ":2", "colocated:1", "split:0+1", ""):
        with pytest.raises(ValueError):
            F.parse_placements(bad)


def test_relative_error_is_signed_and_relative_to_measured():
    assert F.rel_error(1.1, 1.0) == pytest.approx(0.1)
    assert F.rel_error(0.45, 0.5) == pytest.approx(-0.1)
    assert F.rel_error(0.0, 0.0) == 0.0
    assert math.isinf(F.rel_error(0.2, 0.0))
    assert math.isnan(F.rel_error(None, 1.0)) and math.isnan(F.rel_error(1.0, math.nan))


def _row(rate, measured, predicted, placement="split:1+1"):
    row = {"workload": "w2", "placement": placement, "rate_rps": rate, "measured": measured}
    row["figures"] = F.compare(predicted, measured)
    return row


BASE = {"goodput_rps": 2.0, "ttft_p50_s": 0.2, "ttft_p90_s": 0.3, "tpot_p50_s": 0.02, "itl_p50_s": 0.02}
SUSTAINED = {**BASE, "sustained": True, "slo_ttft_s": 0.4}


def test_saturation_marks_the_first_unsustained_rate_and_every_higher_one():
    rows = [
        _row(4.0, {**SUSTAINED}, BASE),  # sustained itself, but above a rate that was not
        _row(1.0, {**SUSTAINED}, BASE),
        _row(2.0, {**SUSTAINED, "sustained": False}, BASE),
        _row(4.0, {**SUSTAINED}, BASE, placement="colocated:2"),  # another placement: its own sweep
        {"workload": "w2", "placement": "split:1+1", "rate_rps": 8.0, "error": "exit 2"},
    ]
    F.mark_saturation(rows)
    assert [r.get("saturated") for r in rows] == [True, False, True, False, None]
    # the slo rule also counts a TTFT p90 over the SLO
    slow = [_row(1.0, {**SUSTAINED, "ttft_p90_s": 0.5}, BASE)]
    F.mark_saturation(slow, "load")
    assert slow[0]["saturated"] is False
    F.mark_saturation(slow, "slo")
    assert slow[0]["saturated"] is True


def test_target_reads_the_four_figures_below_saturation_only():
    near = {k: v * 1.09 for k, v in BASE.items()}  # 9 % high everywhere
    off_tpot = {**BASE, "tpot_p50_s": 0.0225}  # 12.5 % high
    off_itl = {**BASE, "itl_p50_s": 0.05}  # ITL is shown, not part of the target
    rows = [_row(1.0, {**SUSTAINED}, near), _row(1.0, {**SUSTAINED}, off_tpot, "colocated:2")]
    rows += [_row(1.0, {**SUSTAINED}, off_itl, "auto:2"), _row(2.0, {**SUSTAINED, "sustained": False}, off_tpot)]
    F.mark_saturation(rows)
    assert [F.within_target(r) for r in rows] == [True, False, True, None]
    text = F.verdict(rows)
    assert "2 of 3 rows" in text and "tpot_p50_s +12%" in text
    table = F.markdown_table(rows)
    assert "| w2 | split:1+1 | 1 | 2.18 / 2.00 (+9%) | 218 / 200 (+9%) |" in table
    assert table.count("\n") == len(rows) + 1
    assert "No row below saturation" in F.verdict(rows[3:])
