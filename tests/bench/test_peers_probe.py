"""benchmarks/peers_probe.py: the machine probe taken before each system of peers.py, and the report's
note when it moved between systems."""

from __future__ import annotations

from tests.bench._scripts import load_script

P = load_script("peers_probe")


def test_the_probe_measures_bandwidth_and_gemm_rate_and_restores_the_threads():
    import torch

    before = torch.get_num_threads()
    probe = P.machine_probe()
    assert probe["read_gbps"] > 0.1 and probe["bf16_tflops"] > 0.001
    assert torch.get_num_threads() == before


def test_a_steady_machine_gets_its_figures_and_no_warning():
    probes = {
        "vllm": {"read_gbps": 12.6, "bf16_tflops": 1.00},
        "pdserve-split": {"read_gbps": 12.3, "bf16_tflops": 0.98},
    }
    lines = P.probe_note(probes)
    assert len(lines) == 1 and "vllm 12.6 GB/s, 1.00 TFLOP/s" in lines[0] and "pdserve-split 12.3 GB/s" in lines[0]


def test_a_drifting_machine_is_flagged_per_figure():
    probes = {
        "vllm": {"read_gbps": 12.6, "bf16_tflops": 1.00},
        "pdserve-auto": {"read_gbps": 10.9, "bf16_tflops": 0.99},
    }
    lines = P.probe_note(probes)
    assert len(lines) == 2 and "read bandwidth moved 13% between systems" in lines[1]
    assert P.probe_note({}) == []
