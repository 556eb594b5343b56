"""``pdserve plan`` searches groups of workers that one router pools, not lone workers: its
colocated candidate is ``min(N, --max-unit)`` workers and each split ratio its largest multiple
that fits there."""

from __future__ import annotations

from pdserve.planner.plan import candidates, workers_of
from tests.planner.test_plan import plan, profile

TIGHT = ["--slo-ttft-ms", "200", "--slo-tpot-ms", "60"]  # a 64-token prompt's prefill is about 130 ms


def test_candidates_are_groups_of_about_the_cap():
    assert {c.unit for c in candidates(1)} == {1}
    two = candidates(2)
    assert {(c.placement, c.num_prefill, c.num_decode) for c in two} == {("colocated", 2, 0), ("split", 1, 1)}
    big = candidates(1000)  # --max-unit 4
    assert {(c.num_prefill, c.num_decode) for c in big if c.placement == "split"} == {
        (2, 2), (2, 1), (1, 2), (3, 1), (1, 3)
    }  # fmt: skip
    assert {c.unit for c in big if c.placement == "colocated"} == {4}
    assert {(c.num_prefill, c.num_decode) for c in candidates(3) if c.placement == "split"} == {(1, 1), (2, 1), (1, 2)}
    row = {"placement": "colocated", "num_prefill": 4, "num_decode": 0}
    assert workers_of(row, 250) == {"colocated": 1000}


def test_two_pooled_workers_serve_more_each_than_one_alone(tmp_path):
    """With a TTFT SLO near a prompt's prefill time, a lone worker misses it whenever a request
    comes in while it computes another's prompt; two pooled workers send it to the free one."""
    prof = profile(2e-3, 1e-4)
    code1, _, _, one = plan(tmp_path, prof, "1", *TIGHT)
    code2, out, _, two = plan(tmp_path, prof, "2", *TIGHT)
    assert code1 == code2 == 0
    alone = next(c for c in one["candidates"] if c["placement"] == "colocated")
    pooled = next(c for c in two["candidates"] if c["placement"] == "colocated")
    assert (alone["unit"], pooled["unit"]) == (1, 2)
    assert pooled["goodput_per_worker_rps"] > 1.2 * alone["goodput_per_worker_rps"] > 0
    if two["best"]["placement"] == "colocated":
        assert two["best"]["workers"] == {"colocated": 2} and "colocated 2 seqs=" in out
