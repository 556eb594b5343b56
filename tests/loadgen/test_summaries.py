"""A run's summary on synthetic timestamps (docs/benchmarking.md, "Metric definitions"): percentiles,
throughput, goodput, the breakdown, degenerate runs, the keys of summary.json old and new; and the metric
modules load without torch or ray."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.loadgen.metrics import SLO, RequestRecord, percentile, read_summary, run_duration, stats, summarize
from tests.loadgen._records import rec


def test_percentile_matches_numpy_linear_interpolation():
    rng = np.random.default_rng(7)
    data = rng.exponential(0.2, size=257)
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(list(data), p) == pytest.approx(float(np.percentile(data, p)), rel=0, abs=1e-15)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_percentile_ignores_nan_and_empty_is_nan():
    assert percentile([1.0, math.nan, 3.0], 50) == pytest.approx(2.0)
    assert math.isnan(percentile([], 50))
    assert math.isnan(percentile([math.nan, math.nan], 50))


def test_stats_ignore_nan():
    s = stats([4.0, math.nan, 1.0, 2.0, 3.0])
    assert s["count"] == 4
    assert s["mean"] == pytest.approx(2.5)
    assert s["min"] == 1.0 and s["max"] == 4.0
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(float(np.percentile([1, 2, 3, 4], 90)))
    assert s["p99"] == pytest.approx(float(np.percentile([1, 2, 3, 4], 99)))
    empty = stats([math.nan])
    assert empty["count"] == 0 and set(empty) == {"mean", "p50", "p90", "p99", "min", "max", "count"}
    assert all(math.isnan(empty[k]) for k in ("mean", "p50", "p90", "p99", "min", "max"))


def test_failed_requests_excluded_from_latency_but_counted_as_slo_misses():
    good = rec([0.1, 0.2, 0.3], index=0)
    slow_failed = rec([5.0, 9.0], index=1, finish="abort")
    errored = rec([0.1], index=2, finish="error", error="boom")
    s = summarize([good, slow_failed, errored], slo=SLO(1.0, 1.0), duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 1, 2)
    assert s["ttft_count"] == 1 and s["ttft_max_s"] == pytest.approx(0.1)
    assert s["e2e_max_s"] == pytest.approx(0.3)
    assert s["itl_count"] == 2
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["goodput_rps"] == pytest.approx(0.5)


def test_goodput_requires_both_slos():
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    records = [
        rec([0.2, 0.25, 0.3], index=0),  # meets both
        rec([0.4, 0.45], index=1),  # meets both
        rec([0.3], index=2),  # meets both (single token)
        rec([0.9, 0.95, 1.0], index=3),  # misses TTFT only
        rec([0.6], index=4),  # misses TTFT only (single token)
        rec([0.1, 0.4, 0.7], index=5),  # misses TPOT only
        rec([0.2, 0.2, 0.9], index=6),  # misses TPOT only (tpot .35)
        rec([1.0, 1.5, 2.0], index=7),  # misses both
        rec([0.1, 0.15], index=8, finish="abort"),  # would meet both but failed
    ]
    assert [slo.met(r) for r in records] == [True, True, True] + [False] * 6
    s = summarize(records, slo=slo, duration_s=4.0)
    assert (s["slo_ttft_s"], s["slo_tpot_s"]) == (0.5, 0.1)
    assert s["goodput_rps"] == pytest.approx(3 / 4.0)
    assert s["slo_attainment"] == pytest.approx(3 / 9)
    assert s["request_throughput_rps"] == pytest.approx(8 / 4.0)
    # default duration: first send (0) .. last token (2.0)
    s2 = summarize(records, slo=slo)
    assert s2["duration_s"] == pytest.approx(2.0)
    assert s2["goodput_rps"] == pytest.approx(1.5)


def test_throughput_math_and_default_duration():
    records = [
        rec([1.5, 2.0, 2.5], sent=1.0, prompt=100, index=0),
        rec([2.0, 4.0], sent=1.5, prompt=50, index=1, finish="length"),
        rec([3.0, 7.0], sent=2.0, prompt=1000, index=2, finish="error", error="x"),  # counts for duration only
    ]
    assert run_duration(records) == pytest.approx(6.0)
    s = summarize(records)
    assert s["duration_s"] == pytest.approx(6.0)
    assert s["request_throughput_rps"] == pytest.approx(2 / 6.0)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 6.0)
    assert s["total_tokens_per_s"] == pytest.approx(155 / 6.0)
    assert not any(k.startswith(("goodput", "slo")) for k in s)
    s = summarize(records, duration_s=10.0)
    assert s["output_tokens_per_s"] == pytest.approx(0.5)


def test_breakdown_means_over_ok_requests():
    records = [
        rec([0.1, 0.2], index=0, queue_s=0.01, prefill_s=0.1, kv_transfer_s=0.02, decode_s=0.5),
        rec([0.1, 0.2], index=1, queue_s=0.03, prefill_s=0.3, kv_transfer_s=0.04, decode_s=0.7),
        rec([0.1, 0.2], index=2, finish="abort", queue_s=9.0, prefill_s=9.0, kv_transfer_s=9.0, decode_s=9.0),
    ]
    s = summarize(records)
    b = {k: s[f"{k}_mean_s"] for k in ("queue", "prefill", "kv_transfer", "decode")}
    assert b == pytest.approx({"queue": 0.02, "prefill": 0.2, "kv_transfer": 0.03, "decode": 0.6})


def test_degenerate_runs_give_nan_not_errors():
    s = summarize([])
    assert (s["requests"], s["completed"], s["failed"]) == (0, 0, 0)
    assert math.isnan(s["duration_s"]) and math.isnan(s["request_throughput_rps"])
    s = summarize([], slo=SLO(1, 1))
    assert math.isnan(s["slo_attainment"]) and math.isnan(s["goodput_rps"])
    failed = [rec([], finish="error", error="refused", index=i) for i in range(3)]
    s = summarize(failed, slo=SLO(1, 1))
    assert s["failed"] == 3 and s["ttft_count"] == 0 and math.isnan(s["ttft_p90_s"])
    # nothing ran to completion: duration is undefined, but throughput and goodput are plainly 0
    assert math.isnan(s["duration_s"])
    assert s["slo_attainment"] == 0.0 and s["goodput_rps"] == 0.0 and s["request_throughput_rps"] == 0.0
    assert s["output_tokens_per_s"] == 0.0
    assert all(math.isnan(s[f"{k}_mean_s"]) for k in ("queue", "prefill", "kv_transfer", "decode"))
    # all tokens at the send instant: zero duration -> nan throughput, not ZeroDivisionError
    s = summarize([rec([0.0], sent=0.0)], slo=SLO(1, 1))
    assert s["duration_s"] == 0.0 and math.isnan(s["request_throughput_rps"]) and math.isnan(s["goodput_rps"])
    assert s["slo_attainment"] == 1.0


def test_summary_json_safe():
    from pdserve.loadgen.metrics import json_safe

    s = summarize([rec([], finish="error", error="x")], slo=SLO(1, 1))
    text = json.dumps(json_safe(s), allow_nan=False)
    assert json.loads(text)["ttft_p90_s"] is None


def test_summary_counts_kv_moved_and_decode_side_prefills_of_completed_requests():
    a, b, failed = rec([0.1, 0.2], index=0), rec([0.1, 0.2], index=1), rec([0.1], index=2)
    a.kv_transfer_bytes, a.cached_prompt_tokens = 4096, 32
    b.prefilled_on_decode, b.cached_prompt_tokens = True, 16
    failed.kv_transfer_bytes, failed.error = 999, "boom"
    s = summarize([a, b, failed])
    assert (s["kv_transfer_bytes"], s["prefilled_on_decode"], s["cached_prompt_tokens"]) == (4096, 1, 48)
    assert RequestRecord.from_json(json.loads(json.dumps(b.to_json()))).prefilled_on_decode


STATS = ("mean", "p50", "p90", "p99", "min", "max")
METRICS = ("ttft", "tpot", "itl", "e2e")


def test_summary_keys_end_in_their_unit():
    s = summarize([rec([0.1, 0.2, 0.4], index=0), rec([0.3], index=1)], slo=SLO(1, 1))
    for name in METRICS:
        assert {f"{name}_{k}_s" for k in STATS} | {f"{name}_count"} <= s.keys()
    units = ("_s", "_rps", "_tokens_per_s", "_bytes", "_count")
    unitless = {"requests", "completed", "failed", "slo_attainment", "prefilled_on_decode", "cached_prompt_tokens"}
    assert {k for k in s if not k.endswith(units)} == unitless
    assert s["tpot_p50_s"] == pytest.approx(percentile([0.15], 50))
    assert s["ttft_p90_s"] == pytest.approx(percentile([0.1, 0.3], 90))


def test_summaries_in_the_nested_keys_are_read_in_the_flat_ones():
    records = [rec([0.1, 0.2, 0.4], index=0, queue_s=0.01), rec([0.3], index=1, prefill_s=0.2)]
    new = json.loads(json.dumps(summarize(records, slo=SLO(1, 0.5), duration_s=2.0)))
    old = {  # a summary.json with the keys of the earlier releases, of the same run
        **{k: new[k] for k in ("requests", "completed", "failed", "duration_s", "slo_attainment")},
        **{f"{m}_s": {**{k: new[f"{m}_{k}_s"] for k in STATS}, "count": new[f"{m}_count"]} for m in METRICS},
        "request_throughput": new["request_throughput_rps"],
        "output_token_throughput": new["output_tokens_per_s"],
        "total_token_throughput": new["total_tokens_per_s"],
        "breakdown_s": {k: new[f"{k}_mean_s"] for k in ("queue", "prefill", "kv_transfer", "decode")},
        "kv_transfer_bytes": 0,
        "prefilled_on_decode": 0,
        "cached_prompt_tokens": 0,
        "slo": {"ttft_s": 1, "tpot_s": 0.5},
        "goodput": new["goodput_rps"],
        "rate": 2.0,
    }
    assert read_summary(old) == {**new, "rate_rps": 2.0}
    assert read_summary(new) == new


def test_bench_never_imports_torch_or_ray():
    code = (
        "import sys, pdserve.loadgen.metrics, pdserve.loadgen.plots, pdserve.loadgen.prefix_cache; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parents[2]))
