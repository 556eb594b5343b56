"""ClusterConfig: roles per placement, CPU pinning sets and the model id clients see."""

from __future__ import annotations

import pytest

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
    assert cfg.roles == ["colocated", "colocated"] and cfg.cpu_sets(2) == [[0], [1]]


def test_the_served_model_name_is_never_a_path(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()

    def name(model: str, model_name: str | None = None) -> str:
        return ClusterConfig(engine=EngineConfig(model=model), model_name=model_name).served_model_name

    assert name(str(folder)) == "my-llama"
    assert name("/nowhere/models/other") == "other"
    for spec in ("embedded:llama-80m", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M"):  # ids, not paths
        assert name(spec) == spec
    assert name(str(folder), "served-name") == "served-name"


def test_one_colocated_worker_is_a_cluster_and_none_is_refused():
    """``pdserve plan --workers 1`` may advise one colocated worker: serve starts it."""
    one = ClusterConfig(engine=EngineConfig(model="embedded"), placement="colocated", num_prefill=0, num_decode=1)
    assert one.roles == ["colocated"]
    with pytest.raises(ValueError, match="colocated needs at least one worker"):
        ClusterConfig(engine=EngineConfig(model="embedded"), placement="colocated", num_prefill=0, num_decode=0)
    with pytest.raises(ValueError, match="at least one prefill and one decode worker"):
        ClusterConfig(engine=EngineConfig(model="embedded"), placement="split", num_prefill=0, num_decode=1)
