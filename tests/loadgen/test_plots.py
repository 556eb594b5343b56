"""The benchmark figures are written and are real PNGs, also with empty or failed runs."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.loadgen.metrics import SLO, RequestRecord, summarize
from pdserve.loadgen.plots import plot_breakdown, plot_cdfs, plot_vs_rate, write_all

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLO_ = SLO(ttft_s=0.25, tpot_s=0.03)


def synthetic_run(seed: int, rate: float, n: int = 40, split: bool = False) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.exponential(1 / rate)
        ttft = rng.gamma(2.0, 0.05 if split else 0.08)
        gaps = rng.gamma(2.0, 0.008 if split else 0.015, size=int(rng.integers(1, 30)))
        times = list(t + ttft + np.concatenate([[0.0], np.cumsum(gaps)]))
        out.append(
            RequestRecord(
                i,
                f"req-{i}",
                scheduled_s=t,
                sent_s=t,
                prompt_tokens=int(rng.integers(5, 200)),
                max_tokens=len(times),
                token_times_s=times,
                finish_reason="length",
                queue_s=0.01 * rate,
                prefill_s=0.05,
                kv_transfer_s=0.01 if split else 0.0,
                decode_s=float(times[-1] - times[0]),
            )
        )
    return out


def failed_run(n: int = 5) -> list[RequestRecord]:
    return [
        RequestRecord(
            i,
            f"bad-{i}",
            scheduled_s=i * 0.1,
            sent_s=i * 0.1,
            prompt_tokens=10,
            max_tokens=8,
            token_times_s=[],
            finish_reason="error",
            error="UNAVAILABLE",
        )
        for i in range(n)
    ]


def summaries_of(runs, slo):
    return {
        name: {rate: summarize(recs, slo=slo) for rate, recs in per_rate.items()} for name, per_rate in runs.items()
    }


def assert_pngs(paths, names=("cdf.png", "vs_rate.png", "breakdown.png")):
    assert [p.name for p in paths] == list(names)
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC, p
        assert len(data) > 5 * 1024, (p, len(data))


@pytest.mark.parametrize("slo", [SLO_, None])
def test_write_all_two_placements_two_rates(tmp_path, slo):
    runs = {
        "colocated": {1.0: synthetic_run(1, 1.0), 4.0: synthetic_run(2, 4.0)},
        "split": {1.0: synthetic_run(3, 1.0, split=True), 4.0: synthetic_run(4, 4.0, split=True)},
    }
    paths = write_all(runs, summaries_of(runs, slo), tmp_path / "figs", slo=slo)
    assert_pngs(paths)
    assert all(p.parent == tmp_path / "figs" for p in paths)


def test_write_all_with_failed_and_empty_runs(tmp_path):
    runs = {
        "colocated": {1.0: synthetic_run(1, 1.0), 8.0: failed_run()},
        "split": {1.0: synthetic_run(3, 1.0, split=True), 8.0: []},
    }
    summaries = summaries_of(runs, SLO_)
    assert summaries["colocated"][8.0]["completed"] == 0
    assert_pngs(write_all(runs, summaries, tmp_path, slo=SLO_))


def test_placement_missing_a_rate_and_no_runs_at_all(tmp_path):
    runs = {"colocated": {2.0: synthetic_run(5, 2.0)}, "split": {4.0: synthetic_run(6, 4.0, split=True)}}
    assert_pngs(write_all(runs, summaries_of(runs, SLO_), tmp_path / "a", slo=SLO_))
    paths = [
        plot_cdfs({}, tmp_path / "b" / "c.png"),
        plot_vs_rate({}, tmp_path / "b" / "v.png"),
        plot_breakdown({}, tmp_path / "b" / "bd.png"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_plots_do_not_use_pyplot(tmp_path):
    import sys

    runs = {"split": {1.0: synthetic_run(7, 1.0, split=True)}}
    write_all(runs, summaries_of(runs, None), tmp_path)
    if "matplotlib.pyplot" in sys.modules:  # imported by something else; then no figures may be left open
        import matplotlib.pyplot as plt

        assert plt.get_fignums() == []


def test_summaries_read_back_from_json_in_either_key_scheme(tmp_path):
    """summary.json files: nan written as null, and the nested keys of earlier releases."""
    import json

    from pdserve.loadgen.metrics import json_safe

    runs = {"split": {1.0: synthetic_run(8, 1.0, split=True), 8.0: failed_run()}}
    current = json.loads(json.dumps(json_safe(summaries_of(runs, SLO_))))
    assert current["split"]["8.0"]["ttft_p90_s"] is None  # JSON keys are strings
    nested = {
        "colocated": {
            1.0: {
                "ttft_s": {"p90": 0.2, "count": 3},
                "tpot_s": {"p90": 0.02, "count": 3},
                "goodput": 0.9,
                "breakdown_s": {"queue": 0.01, "prefill": 0.05, "kv_transfer": 0.0, "decode": 0.3},
            }
        }
    }
    for summaries in (current, nested, {**current, **nested}):
        for p in (plot_vs_rate(summaries, tmp_path / "v.png"), plot_breakdown(summaries, tmp_path / "b.png")):
            assert p.read_bytes()[:8] == PNG_MAGIC
