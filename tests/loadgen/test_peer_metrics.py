"""benchmarks/peers_metrics.py: vLLM's benchmark results read as records with pdserve bench's metric
definitions."""

from __future__ import annotations

import pytest

from pdserve.loadgen.metrics import SLO, summarize
from tests.bench._scripts import load_script


def _peers_metrics():
    return load_script("peers_metrics")


def test_peer_benchmark_reads_vllm_results_with_the_same_definitions():
    """vLLM's saved TTFTs, ITLs and latencies become records whose TTFT, TPOT and ITL are vLLM's own
    figures, summarized with the same percentile, SLO check and goodput as pdserve bench's records."""
    peers = _peers_metrics()
    ttfts, itls = [0.2, 0.3, 0.25], [[0.05, 0.05, 0.1], [0.02, 0.02, 0.02], []]
    result = {
        "start_times": [10.0, 10.5, 11.0],
        "ttfts": ttfts,
        "itls": itls,
        "latencies": [t + sum(g) for t, g in zip(ttfts, itls)],
        "output_lens": [4, 4, 0],
        "input_lens": [16, 17, 16],
        "errors": ["", "", "timeout"],
        "duration": 1.5,
    }
    records, duration, reported = peers.vllm_records(result)
    assert duration == 1.5 and [r.sent_s for r in records] == [0.0, 0.5, 1.0]
    assert [r.ok for r in records] == [True, True, False] and records[2].error == "timeout"
    for r, ttft, gaps, latency in zip(records[:2], ttfts, itls, result["latencies"]):
        assert r.ttft_s == pytest.approx(ttft) and r.itl_s == pytest.approx(gaps)
        assert r.tpot_s == pytest.approx((latency - ttft) / 3)  # vLLM's TPOT: (latency - ttft) / (n - 1)
    slo = SLO(ttft_s=0.25, tpot_s=0.1)
    m = peers.w2_metrics(records, duration, slo)
    expected = summarize(records, slo)
    assert {k: m[k] for k in expected} == pytest.approx(expected, nan_ok=True)
    assert m["goodput_rps"] == pytest.approx(1 / (10.5 + 0.3 + 0.06 - 10.0))  # only the first meets both
    assert m["offered_rps"] == pytest.approx(2 / 1.0) and not m["sustained"]


def test_vllm_chunks_holding_several_tokens_put_the_rest_at_the_last_chunk():
    peers = _peers_metrics()
    result = {"ttfts": [0.1], "itls": [[0.2]], "output_lens": [4], "input_lens": [8], "errors": [""], "duration": 1}
    (r,), _, _ = peers.vllm_records(result)
    assert r.token_times_s == pytest.approx([0.1, 0.3, 0.3, 0.3]) and r.tpot_s == pytest.approx(0.2 / 3)
