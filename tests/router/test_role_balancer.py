"""The P:D policy of ``--placement auto`` (router/role_balancer.py): which move it proposes, and its
hysteresis (patience, cooldown, no move while draining or without traffic)."""

from __future__ import annotations

import pytest

from pdserve.router.role_balancer import RoleBalancer, WorkerLoad, bottleneck


def load(addr: str, role: str, prefill: float, decode: float) -> WorkerLoad:
    return WorkerLoad(addr, role, prefill, decode)


IDLE_PREFILL = [load("p0", "prefill", 0.2, 0.0), load("d0", "decode", 0.05, 0.9)]  # W2 on split 1+1


def test_bottleneck_is_the_busier_side_after_the_move():
    assert bottleneck(IDLE_PREFILL, 1, 1) == pytest.approx(0.95)
    assert bottleneck(IDLE_PREFILL, 0, 2) == pytest.approx((0.2 + 0.95) / 2)  # colocated: all work on 2
    colocated = [load("a", "decode", 0.6, 0.2), load("b", "decode", 0.6, 0.2)]
    assert bottleneck(colocated, 1, 1) == pytest.approx(1.2)  # the prompt work on one worker


def test_an_idle_prefill_worker_beside_a_saturated_decode_worker_moves_to_decode():
    move = RoleBalancer(margin=0.15).best_move(IDLE_PREFILL)
    assert (move.address, move.from_role, move.to_role) == ("p0", "prefill", "decode")
    assert move.predicted < move.bottleneck - 0.15


def test_a_saturated_prefill_worker_beside_idle_decode_workers_spreads_its_work():
    loads = [load("p0", "prefill", 0.95, 0.0), load("d0", "decode", 0.0, 0.1), load("d1", "decode", 0.0, 0.15)]
    b = RoleBalancer()
    move = b.best_move(loads)  # all three colocated (0.4) beats a second prefill worker (0.475)
    assert (move.address, move.to_role, move.predicted) == ("p0", "decode", pytest.approx(0.4))
    b._tpot_split_s = 0.0  # just split for TPOT: the prefill role is held, so a decode worker helps instead
    move = b.best_move(loads, now_s=1.0)
    assert (move.address, move.to_role, move.predicted) == ("d0", "prefill", pytest.approx(0.475))


def test_colocated_workers_over_the_tpot_target_split_off_a_prefill_worker():
    colocated = [load("a", "decode", 0.3, 0.4), load("b", "decode", 0.25, 0.4)]
    b = RoleBalancer(slo_tpot_s=0.040)
    assert b.best_move(colocated, tpot_p90_s=0.030) is None  # within the target: utilisation says stay
    move = b.best_move(colocated, tpot_p90_s=0.060)
    assert (move.address, move.to_role, move.reason) == ("b", "prefill", "tpot")
    no_prompts = [load("a", "decode", 0.02, 0.8), load("b", "decode", 0.02, 0.8)]
    assert b.best_move(no_prompts, tpot_p90_s=0.060) is None  # slow without prompt work: splitting cannot help
    heavy = [load("a", "decode", 0.6, 0.3), load("b", "decode", 0.6, 0.3)]
    assert b.best_move(heavy, tpot_p90_s=0.060) is None  # one prefill worker could not keep up


def test_after_a_tpot_split_utilisation_does_not_empty_the_prefill_role_for_hold_s():
    b = RoleBalancer(slo_tpot_s=0.040, patience=1, cooldown_s=0.0, hold_s=60.0)
    colocated = [load("a", "decode", 0.3, 0.4), load("b", "decode", 0.25, 0.4)]
    assert b.observe(0.0, colocated, tpot_p90_s=0.060).reason == "tpot"
    b.switched(1.0)
    assert b.observe(30.0, IDLE_PREFILL, tpot_p90_s=0.020) is None  # would empty the prefill role: held
    assert b.observe(61.0, IDLE_PREFILL, tpot_p90_s=0.020).to_role == "decode"


def test_balanced_or_idle_clusters_stay_as_they_are():
    b = RoleBalancer()
    assert b.best_move([load("p", "prefill", 0.5, 0.0), load("d", "decode", 0.0, 0.5)]) is None
    assert b.best_move([load("p", "prefill", 0.0, 0.0), load("d", "decode", 0.0, 0.0)]) is None  # no traffic
    assert b.best_move([load("d", "decode", 0.3, 0.6)]) is None  # never the last decode worker


def test_a_move_needs_patience_windows_in_a_row_and_then_a_cooldown():
    b = RoleBalancer(patience=3, cooldown_s=10.0)
    assert b.observe(1.0, IDLE_PREFILL) is None
    assert b.observe(2.0, IDLE_PREFILL) is None
    assert b.observe(3.0, IDLE_PREFILL) is not None  # third window in a row
    b.switched(3.5)
    assert [b.observe(t, IDLE_PREFILL) for t in (4.0, 5.0, 6.0, 13.0)] == [None] * 4  # cooldown
    assert [b.observe(t, IDLE_PREFILL) is not None for t in (14.0, 15.0, 16.0)] == [False, False, True]


def test_one_quiet_window_or_a_drain_resets_the_streak():
    b = RoleBalancer(patience=2, cooldown_s=0.0)
    balanced = [load("p0", "prefill", 0.5, 0.0), load("d0", "decode", 0.0, 0.5)]
    assert b.observe(1.0, IDLE_PREFILL) is None
    assert b.observe(2.0, balanced) is None
    assert b.observe(3.0, IDLE_PREFILL) is None  # the streak starts again
    assert b.observe(4.0, IDLE_PREFILL, draining=True) is None
    assert b.observe(5.0, IDLE_PREFILL) is None
    assert b.observe(6.0, IDLE_PREFILL) is not None


def test_alternating_loads_never_flip_back_and_forth_within_the_cooldown():
    b = RoleBalancer(patience=1, cooldown_s=10.0)
    heavy = [load("p0", "decode", 0.9, 0.05), load("d0", "decode", 0.9, 0.05), load("d1", "decode", 0.9, 0.05)]
    switches = []
    for t in range(60):
        loads = IDLE_PREFILL if t % 2 else heavy
        if b.observe(float(t), loads) is not None:
            switches.append(t)
            b.switched(float(t))
    assert all(b2 - a >= 10 for a, b2 in zip(switches, switches[1:]))


@pytest.mark.parametrize("kwargs", [{"margin": 1.0}, {"patience": 0}, {"cooldown_s": -1.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="role balancer"):
        RoleBalancer(**kwargs)
