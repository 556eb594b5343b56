"""benchmarks/peers.py --rounds: the systems' order reversed every other round (ABBA) and a rate's
figures pooled over the rounds."""

from __future__ import annotations

import pytest

from pdserve.loadgen.metrics import SLO, RequestRecord
from tests.bench._scripts import load_script

RUNS = load_script("peers_runs")
METRICS = load_script("peers_metrics")
REPORT = load_script("peers_report")
SLO_W2 = SLO(ttft_s=0.4, tpot_s=0.04)


def _round(n: int, gap_s: float, ttft_s: float, tpot_s: float) -> list[RequestRecord]:
    """``n`` requests sent ``gap_s`` apart, each with 9 tokens: the first ``ttft_s`` after its send,
    then one every ``tpot_s``."""
    out = []
    for i in range(n):
        sent = i * gap_s
        times = [sent + ttft_s + k * tpot_s for k in range(9)]
        out.append(
            RequestRecord(
                index=i,
                request_id=f"r{i}",
                scheduled_s=sent,
                sent_s=sent,
                prompt_tokens=16,
                max_tokens=9,
                token_times_s=times,
                finish_reason="length",
            )
        )
    return out


def test_rounds_alternate_the_order_of_the_systems():
    systems = ["vllm", "pdserve-colocated", "pdserve-split"]
    assert RUNS.round_order(systems, 0) == systems
    assert RUNS.round_order(systems, 1) == ["pdserve-split", "pdserve-colocated", "vllm"]
    assert RUNS.round_order(systems, 2) == systems
    assert systems == ["vllm", "pdserve-colocated", "pdserve-split"]  # not reversed in place


def test_a_rate_pools_the_requests_of_every_round():
    fast = _round(10, 0.25, 0.1, 0.02)  # every request meets the SLO
    slow = _round(10, 0.25, 0.1, 0.05)  # none does: TPOT 50 ms
    one, two = METRICS.w2_metrics(fast, 3.0, SLO_W2), METRICS.w2_metrics(slow, 3.0, SLO_W2)
    pooled = METRICS.pooled_metrics([(fast, one), (slow, {**two, "busy_cores_before": 0.1})], SLO_W2)
    assert pooled["requests"] == 20 and pooled["slo_attainment"] == pytest.approx(0.5)
    assert pooled["duration_s"] == pytest.approx(one["duration_s"] + two["duration_s"])
    assert pooled["goodput_rps"] == pytest.approx(10 / pooled["duration_s"])
    assert pooled["goodput_by_round_rps"] == pytest.approx([one["goodput_rps"], 0.0])
    assert pooled["tpot_p50_s"] > one["tpot_p50_s"] and pooled["tpot_max_s"] == pytest.approx(two["tpot_max_s"])
    assert pooled["offered_rps"] == pytest.approx(one["offered_rps"])
    assert pooled["busy_cores_before"] == 0.1 and pooled["client_duration_s"] == 6.0


def test_a_rate_is_sustained_only_when_every_round_sustained_it():
    kept = _round(10, 0.25, 0.1, 0.02)
    lost = _round(10, 0.25, 0.1, 0.02)
    lost[-1].token_times_s.clear()
    lost[-1].error, lost[-1].finish_reason = "no output token", "error"
    kept_m, lost_m = METRICS.w2_metrics(kept, 3.0, SLO_W2), METRICS.w2_metrics(lost, 3.0, SLO_W2)
    assert METRICS.pooled_metrics([(kept, kept_m)], SLO_W2)["sustained"]
    assert not METRICS.pooled_metrics([(kept, kept_m), (lost, lost_m)], SLO_W2)["sustained"]


def test_the_report_names_each_rounds_probe():
    probe = {"read_gbps": 12.0, "bf16_tflops": 1.0}
    w2 = {"vllm": {"probe": probe, "probes": [probe, probe]}, "pdserve-split": {"probe": probe, "probes": [probe]}}
    assert list(REPORT.round_probes(w2)) == ["vllm (round 1)", "vllm (round 2)", "pdserve-split"]


def test_a_report_without_vllm_or_w1_names_neither():
    import argparse
    from pathlib import Path

    machine = {
        "cpu": "CPU",
        "cores": 2,
        "usable_cores": 2,
        "bf16_isa": [],
        "platform": "Linux",
        "torch": "2",
        "transformers": "5",
        "python": "3",
    }
    info = {"machine": machine, "command": "peers.py", "pdserve_versions": {}}
    args = argparse.Namespace(skip_vllm=True, max_model_len=512, kv_cache_gib=2, model="embedded:llama-80m")
    text = REPORT.report(info, args, Path("/m/model"), None, None, Path("/o"))
    assert text.startswith("# pdserve: model") and "vLLM-CPU:" not in text.splitlines()[0]
    assert "raw: /o/peers.json, logs in /o/logs/" in text and "/o/w1/" not in text
