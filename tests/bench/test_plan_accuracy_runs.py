"""benchmarks/plan_accuracy_runs.py: the simulator's prediction against the mean of several measured
runs, beside the runs' own spread, from plan_accuracy.py ``--out`` folders made here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench._scripts import BENCHMARKS, load_script

R = load_script("plan_accuracy_runs")
FIGS = ("goodput_rps", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s")


def write_run(out: Path, run: str, kind: str, *figures: float) -> None:
    """``out/run/kind/summary.json`` with ``FIGS``' values (goodput req/s, TTFT p50 / p90, TPOT p50 s)."""
    folder = out / run / kind
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(dict(zip(FIGS, figures))))


def three_runs(tmp_path: Path) -> list[Path]:
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for out, ttft in zip(outs, (0.090, 0.100, 0.110)):  # the measured TTFT p50 spreads 90-110 ms
        write_run(out, "w2/split-1p1/rate_4", "measured", 3.3, ttft, 0.2, 0.02)
        write_run(out, "w2/split-1p1/rate_8", "measured", 6.4, ttft, 0.3, 0.03)
    write_run(outs[0], "w2/colocated-2/rate_4", "measured", 3.3, 0.08, 0.1, 0.02)
    last = outs[-1]  # its predictions: one within 10 % of every mean, one TPOT 20 % high
    write_run(last, "w2/split-1p1/rate_4", "predicted", 3.3, 0.105, 0.21, 0.02)
    write_run(last, "w2/split-1p1/rate_8", "predicted", 6.4, 0.1, 0.3, 0.036)
    return outs


def test_the_prediction_is_held_against_the_mean_of_the_runs(tmp_path):
    rows = R.rows(three_runs(tmp_path), tmp_path / "out2")
    assert [r["run"] for r in rows] == ["w2/split-1p1/rate_4", "w2/split-1p1/rate_8"]  # in every folder only
    ttft = rows[0]["figures"]["ttft_p50_s"]
    assert (ttft["min"], ttft["max"]) == (0.090, 0.110) and ttft["mean"] == pytest.approx(0.100)
    assert ttft["cv"] == pytest.approx(0.1) and ttft["rel_error"] == pytest.approx(0.05)
    assert rows[1]["figures"]["tpot_p50_s"]["rel_error"] == pytest.approx(0.2)
    table = R.table(rows, 3)
    assert table.count("| yes |") == 1 and table.count("| **no** |") == 1
    assert "90-110, 100, 10%; 105 (+5%)" in table and "1 of 2 rows within 10 % of the mean of 3 measured runs" in table


def test_the_script_prints_the_table_and_refuses_folders_with_nothing_in_common(tmp_path):
    outs = [str(o) for o in three_runs(tmp_path)]
    script = str(BENCHMARKS / "plan_accuracy_runs.py")
    done = subprocess.run([sys.executable, script, *outs], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "w2/split-1p1/rate_8" in done.stdout and "+20%" in done.stdout
    (tmp_path / "empty").mkdir()
    bad = subprocess.run([sys.executable, script, outs[0], str(tmp_path / "empty")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no run folder" in bad.stderr
    missing = subprocess.run([sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such folder" in missing.stderr


@pytest.mark.parametrize(
    "damage, message",
    [
        ("not json", "not a summary.json"),
        ("[1, 2]", "not a summary.json"),
        ('{"goodput_rps": "abc", "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "tpot_p50_s": 0.02}', "goodput_rps is 'abc'"),
        ('{"ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "tpot_p50_s": 0.02}', "has no goodput_rps"),
    ],
)
def test_a_damaged_summary_is_one_error_line_naming_it(tmp_path, damage, message):
    outs = three_runs(tmp_path)
    (outs[1] / "w2/split-1p1/rate_8/measured/summary.json").write_text(damage)
    (outs[0] / "w2/split-1p1/rate_x/measured").mkdir(parents=True)  # no rate: not a run folder
    (outs[0] / "w2/split-1p1/rate_x/measured/summary.json").write_text("{}")
    script = str(BENCHMARKS / "plan_accuracy_runs.py")
    done = subprocess.run([sys.executable, script, *map(str, outs)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    twice = subprocess.run([sys.executable, script, str(outs[0]), str(outs[0])], capture_output=True, text=True)
    assert twice.returncode == 2 and "given twice" in twice.stderr
    nowhere = [sys.executable, script, *map(str, outs), "--predicted", str(tmp_path / "nope")]
    assert "no such folder" in subprocess.run(nowhere, capture_output=True, text=True).stderr
