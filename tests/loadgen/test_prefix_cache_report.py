"""The prefix-cache report of a bench run: hit rates from the workers' counters before and after."""

from __future__ import annotations

import json
import math


def test_prefix_cache_report_takes_deltas_per_worker():
    from pdserve.loadgen.metrics import json_safe
    from pdserve.loadgen.prefix_cache import WorkerPrefixCounters as W
    from pdserve.loadgen.prefix_cache import format_prefix_cache, prefix_cache_report

    before = [W("prefill", "a:1", 1000, 200), W("decode", "b:2", 0, 0), W("prefill", "c:3", 500, 400)]
    after = [
        W("prefill", "a:1", 3000, 1200),
        W("decode", "b:2", 0, 0),
        W("prefill", "c:3", 100, 50),
        W("prefill", "d:4", 400, 100),
    ]  # c restarted during the run, d replaced a worker
    report = prefix_cache_report(before, after)
    assert [(w["address"], w["query_tokens"], w["hit_tokens"]) for w in report["workers"]] == [
        ("a:1", 2000, 1000),
        ("b:2", 0, 0),
        ("c:3", 100, 50),
        ("d:4", 400, 100),
    ]
    assert [w["hit_rate"] for w in report["workers"]][::2] == [0.5, 0.5]
    assert math.isnan(report["workers"][1]["hit_rate"])  # a decode worker admits no prompt
    assert (report["query_tokens"], report["hit_tokens"], report["hit_rate"]) == (2500, 1150, 0.46)
    lines = format_prefix_cache(report).splitlines()
    assert lines[1:3] == ["  prefill a:1: 50.0% (1,000 / 2,000)", "  decode b:2: n/a"]
    assert lines[-1] == "  all workers: 46.0% (1,150 / 2,500)"
    assert json.loads(json.dumps(json_safe(report), allow_nan=False))["workers"][1]["hit_rate"] is None


def test_prefix_cache_report_without_counters_is_na():
    from pdserve.loadgen.prefix_cache import WorkerPrefixCounters as W
    from pdserve.loadgen.prefix_cache import format_prefix_cache, prefix_cache_report

    assert prefix_cache_report(None, None) is None
    assert prefix_cache_report([W("colocated", "a:1", 0, 0)], None) is None
    assert format_prefix_cache(None).startswith("prefix cache hit rate: n/a")


def test_the_ceiling_line_names_the_block_size_it_was_computed_with():
    from pdserve.loadgen.prefix_cache import format_prefix_cache

    report = {"workers": [], "query_tokens": 0, "hit_tokens": 0, "hit_rate": None, "ceiling": 0.5}
    assert "infinite cache of 16-token blocks): 50.0%" in format_prefix_cache(report)
    assert "infinite cache of 7-token blocks)" in format_prefix_cache({**report, "ceiling_block_size": 7})
