"""``pdserve serve --placement auto --plan plan.json``: the first roles taken from a plan."""

from __future__ import annotations

import pytest

from pdserve.planner.plan import first_roles


def plan(placement: str, p: int, d: int, workers: int) -> dict:
    unit = 1 if placement == "colocated" else p + d
    return {"workers": workers, "best": {"placement": placement, "num_prefill": p, "num_decode": d, "unit": unit}}


def test_split_plans_scale_their_unit_and_idle_workers_decode():
    assert first_roles(plan("split", 1, 3, 8)) == (2, 6)
    assert first_roles(plan("split", 1, 2, 8)) == (2, 6)  # 2 units of 1:2, the 2 left over decode
    assert first_roles(plan("split", 1, 1, 1000), 4) == (2, 2)  # a plan for 1,000 workers, served on 4


def test_colocated_plans_start_every_worker_as_a_decode_worker_that_prefills_itself():
    assert first_roles(plan("colocated", 1, 0, 2)) == (0, 2)


@pytest.mark.parametrize(
    ("doc", "n", "words"),
    [
        ({"candidates": []}, None, "not a plan written by pdserve plan \\(no 'best'\\)"),
        ([1, 2], None, "a JSON list, not an object"),
        ({"workers": "many", "best": {"placement": "colocated", "unit": 1}}, None, "a bad value"),
        (plan("split", 1, 3, 8), 2, "needs 4 workers, not 2"),
    ],
)
def test_bad_plans_get_a_clear_error(doc, n, words):
    with pytest.raises(ValueError, match=words):
        first_roles(doc, n)
