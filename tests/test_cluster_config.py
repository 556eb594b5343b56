"""ClusterConfig: roles per placement and CPU pinning sets."""

from __future__ import annotations

from pdserve.cluster.config import ClusterConfig
from pdserve.engine.config import EngineConfig


def test_cpu_sets_are_disjoint_shares_in_role_order():
    cfg = ClusterConfig(engine=EngineConfig(model="embedded"), num_prefill=1, num_decode=2, cpus_per_worker=2)
    assert cfg.roles == ["prefill", "decode", "decode"]
    assert cfg.cpu_sets(8) == [[0, 1], [2, 3], [4, 5]]
    assert cfg.cpu_sets(6) == [[0, 1], [2, 3], [4, 5]]
    assert cfg.cpu_sets(5) is None  # does not fit: no pinning, the OS shares the cores


def test_colocated_uses_both_pools_worth_of_workers():
    cfg = ClusterConfig(engine=EngineConfig(model="embedded"), placement="colocated")
    assert cfg.roles == ["both", "both"] and cfg.cpu_sets(2) == [[0], [1]]
