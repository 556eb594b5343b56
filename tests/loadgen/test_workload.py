"""Arrival schedules and lengths: Azure trace replay, synthetic processes, clipping, workload assembly."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.loadgen.dataset_files import resolve_datasets_dir
from pdserve.loadgen.workload import (
    TRACES,
    RequestSpec,
    TraceRow,
    build_workload,
    clip_lengths,
    gamma_arrivals,
    load_trace,
    poisson_arrivals,
    sample_rows,
    scale_to_rate,
    window,
)

DATASETS = Path(__file__).resolve().parents[3] / "shared" / "datasets"
AZURE = DATASETS / "azure_llm_trace_2023"


@pytest.fixture(scope="module")
def datasets_dir() -> Path:
    if not AZURE.is_dir():
        pytest.skip(f"{DATASETS} is absent")
    return DATASETS


@pytest.fixture(scope="module")
def conv(datasets_dir) -> list[TraceRow]:
    return load_trace("azure-conv", datasets_dir)


def _raw_csv(name: str) -> list[list[str]]:
    with (DATASETS / TRACES[name]).open(newline="") as f:
        return list(csv.reader(f))[1:]


def _cv(x) -> float:
    x = np.asarray(x)
    return float(x.std() / x.mean())


# --- load_trace -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,count,first,second,second_t,rate",
    [
        ("azure-conv", 19_366, (374, 44), (396, 109), 4.314579, 5.53),
        ("azure-code", 8_819, (4808, 10), (3180, 8), 0.052, 2.57),
    ],
)
def test_load_trace_azure(datasets_dir, name, count, first, second, second_t, rate):
    rows = load_trace(name, datasets_dir)
    assert len(rows) == count
    assert rows[0].t_s == 0.0
    assert all(b.t_s >= a.t_s for a, b in zip(rows, rows[1:]))
    assert (rows[0].input_tokens, rows[0].output_tokens) == first
    assert (rows[1].input_tokens, rows[1].output_tokens) == second
    assert rows[1].t_s == pytest.approx(second_t, abs=1e-9)
    assert (len(rows) - 1) / rows[-1].t_s == pytest.approx(rate, abs=0.01)  # the datasets' README.md mean rate
    raw = _raw_csv(name)  # every length as in the file
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(int(a), int(b)) for _, a, b in raw]


def test_load_trace_last_row_time_exact(conv):
    # 19:14:08.4025270 - 18:15:46.6805900, from the file's text; float nanoseconds would drift
    last = _raw_csv("azure-conv")[-1][0]
    hh, mm, ss = last.split(" ")[1].split(":")
    expected = (int(hh) - 18) * 3600 + (int(mm) - 15) * 60 + float(ss) - 46.6805900
    assert conv[-1].t_s == pytest.approx(expected, abs=1e-9)


def test_load_trace_by_path_and_env(datasets_dir, conv, monkeypatch):
    assert load_trace(str(datasets_dir / TRACES["azure-conv"])) == conv
    monkeypatch.delenv("PDSERVE_DATASETS", raising=False)
    assert resolve_datasets_dir() == datasets_dir  # <repo>/../shared/datasets
    assert resolve_datasets_dir("/x/y") == Path("/x/y")
    monkeypatch.setenv("PDSERVE_DATASETS", str(datasets_dir))
    assert load_trace("azure-conv") == conv


def test_load_trace_missing_file_names_path_and_flag(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--datasets-dir") as err:
        load_trace("azure-code", tmp_path)
    assert str(tmp_path / TRACES["azure-code"]) in str(err.value)
    monkeypatch.setenv("PDSERVE_DATASETS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_trace("azure-conv")
    with pytest.raises(FileNotFoundError, match="--datasets-dir"):
        load_trace(str(tmp_path / "missing.csv"))


def _write(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "t.csv"
    path.write_text("\n".join(("TIMESTAMP,ContextTokens,GeneratedTokens",) + lines) + "\n")
    return str(path)


def test_load_trace_small_file_seven_digit_precision(tmp_path):
    rows = load_trace(
        _write(
            tmp_path, "2023-11-16 23:59:59.9999999,5,6", "2023-11-17 00:00:00.0000000,7,8", "2023-11-17 00:00:02.5,9,10"
        )
    )
    assert [r.t_s for r in rows] == [0.0, pytest.approx(1e-7, abs=1e-12), pytest.approx(2.5000001, abs=1e-12)]
    assert rows[2] == TraceRow(rows[2].t_s, 9, 10)


@pytest.mark.parametrize(
    "bad,line",
    [
        ("2023-11-16 18:00:01.0,12", 3),
        ("2023-11-16 18:00:01.0,x,3", 3),
        ("2023-11-16 18:00:01.0,-4,3", 3),
        ("16/11/2023 18:00:01,4,3", 3),
        ("2023-11-16 18:00:01.12a,4,3", 3),
        ("2023-11-16 17:59:59.0,4,3", 3),  # earlier than the row before
    ],
)
def test_load_trace_malformed_rows_give_line_number(tmp_path, bad, line):
    path = _write(tmp_path, "2023-11-16 18:00:00.0000000,1,2", bad, "2023-11-16 18:00:05.0,1,1")
    with pytest.raises(ValueError, match=f"t.csv:{line}:"):
        load_trace(path)


def test_load_trace_wrong_header(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("timestamp,input_length,output_length\n0,1,2\n")
    with pytest.raises(ValueError, match="h.csv:1:.*header"):
        load_trace(str(path))


# --- window / scale_to_rate -----------------------------------------------------------------------


def test_window_keeps_relative_schedule(conv):
    w = window(conv, start_s=600.0, duration_s=20.0)
    expected = [r for r in conv if 600.0 <= r.t_s < 620.0]
    assert len(w) == len(expected) > 50
    assert w[0].t_s == 0.0
    for got, want in zip(w, expected):
        assert got.t_s == pytest.approx(want.t_s - expected[0].t_s, abs=1e-9)
        assert (got.input_tokens, got.output_tokens) == (want.input_tokens, want.output_tokens)
    assert window(conv, 600.0, 20.0, max_requests=10) == w[:10]
    assert window(conv, max_requests=3) == conv[:3]
    assert window(conv, start_s=1e6) == []
    with pytest.raises(ValueError):
        window(conv, duration_s=-1.0)


def test_window_bounds_are_half_open():
    rows = [TraceRow(float(t), t, 1) for t in range(1, 10)]  # t = 1 .. 9
    assert [r.input_tokens for r in window(rows, 3.0, 4.0)] == [3, 4, 5, 6]
    assert [r.t_s for r in window(rows, 3.0, 4.0)] == [0.0, 1.0, 2.0, 3.0]


def test_scale_to_rate_hits_target_and_keeps_spacing(conv):
    w = window(conv, start_s=1200.0, duration_s=30.0)
    for target in (0.5, 20.0, 123.4):
        s = scale_to_rate(w, target)
        assert (len(s) - 1) / (s[-1].t_s - s[0].t_s) == pytest.approx(target, rel=1e-6)
        gaps, new = np.diff([r.t_s for r in w]), np.diff([r.t_s for r in s])
        factor = new.sum() / gaps.sum()
        np.testing.assert_allclose(new, gaps * factor, rtol=1e-9, atol=1e-12)
        assert [(r.input_tokens, r.output_tokens) for r in s] == [(r.input_tokens, r.output_tokens) for r in w]
    slower = scale_to_rate(w, 1.0)
    assert slower[-1].t_s == pytest.approx(len(w) - 1)  # rate 1: n-1 seconds from first to last


@pytest.mark.parametrize(
    "rows,rate",
    [
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], 0.0),
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], -2.0),
        ([TraceRow(0.0, 1, 1), TraceRow(1.0, 1, 1)], math.inf),
        ([TraceRow(0.0, 1, 1)], 1.0),
        ([TraceRow(2.0, 1, 1), TraceRow(2.0, 1, 1)], 1.0),
    ],
)
def test_scale_to_rate_rejects(rows, rate):
    with pytest.raises(ValueError):
        scale_to_rate(rows, rate)


# --- synthetic arrivals ---------------------------------------------------------------------------


def test_poisson_arrivals():
    a = poisson_arrivals(4.0, 20_001, seed=7)
    assert a == poisson_arrivals(4.0, 20_001, seed=7)
    assert a != poisson_arrivals(4.0, 20_001, seed=8)
    assert a[0] == 0.0 and len(a) == 20_001
    gaps = np.diff(a)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert _cv(gaps) == pytest.approx(1.0, rel=0.10)
    assert poisson_arrivals(1.0, 0, 1) == [] and poisson_arrivals(1.0, 1, 1) == [0.0]
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            poisson_arrivals(rate, 10, 1)


@pytest.mark.parametrize("burstiness,cv", [(0.25, 2.0), (1.0, 1.0), (4.0, 0.5)])
def test_gamma_arrivals(burstiness, cv):
    a = gamma_arrivals(10.0, 20_001, burstiness, seed=3)
    assert a == gamma_arrivals(10.0, 20_001, burstiness, seed=3)
    assert a != gamma_arrivals(10.0, 20_001, burstiness, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert _cv(gaps) == pytest.approx(cv, rel=0.10)


def test_gamma_arrivals_rejects_bad_burstiness():
    for b in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError):
            gamma_arrivals(1.0, 10, b, seed=0)


# --- lengths --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,expected",
    [
        ((100, 50, 2048), {}, (100, 50)),
        ((1000, 48, 1048), {}, (1000, 48)),  # exactly max_model_len
        ((1001, 48, 1048), {}, (1000, 48)),  # one over: the input gives way
        ((5000, 100, 2048), {}, (1948, 100)),
        ((10, 3000, 2048), {}, (1, 2047)),  # input at its floor of 1, then the output is trimmed
        ((5, 5, 2), {}, (1, 1)),
        ((0, 0, 64), {}, (1, 1)),
        ((374, 44, 2048), {"length_scale": 0.5}, (187, 22)),
        ((374, 44, 2048), {"length_scale": 0.01}, (4, 1)),
        ((374, 44, 2048), {"length_scale": 3.0}, (1122, 132)),
        ((374, 44, 2048), {"max_input_tokens": 256, "max_output_tokens": 16}, (256, 16)),
        ((4808, 10, 512), {"length_scale": 0.1, "max_output_tokens": 4}, (481, 1)),
        ((4808, 10, 512), {"max_input_tokens": 300}, (300, 10)),
    ],
)
def test_clip_lengths(args, kwargs, expected):
    assert clip_lengths(*args, **kwargs) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_model_len": 1},
        {"length_scale": 0.0},
        {"length_scale": -1.0},
        {"max_input_tokens": 0},
        {"max_output_tokens": 0},
    ],
)
def test_clip_lengths_rejects(kwargs):
    with pytest.raises(ValueError):
        clip_lengths(10, 10, **{"max_model_len": 100, **kwargs})


def test_clip_lengths_over_a_trace_window(datasets_dir):
    code = window(load_trace("azure-code", datasets_dir), max_requests=200)
    clipped = [clip_lengths(r.input_tokens, r.output_tokens, 2048) for r in code]
    assert clipped[:3] == [(2038, 10), (2048 - 8, 8), (110, 27)]
    for r, (inp, out) in zip(code, clipped):
        assert inp >= 1 and out >= 1 and inp + out <= 2048
        assert out == min(r.output_tokens, 2047)  # outputs only shrink when the input is at 1
        assert inp == (r.input_tokens if r.input_tokens + r.output_tokens <= 2048 else 2048 - out)
    assert sum(inp != r.input_tokens for r, (inp, _) in zip(code, clipped)) > 20  # the code trace is long
    half = [clip_lengths(r.input_tokens, r.output_tokens, 512, length_scale=0.25) for r in code]
    assert half[2] == (28, 7)  # 110/4 = 27.5 rounds to 28, 27/4 = 6.75 to 7
    assert all(i + o <= 512 for i, o in half)


def test_sample_rows(conv):
    a = sample_rows(conv, 500, seed=1)
    assert a == sample_rows(conv, 500, seed=1) != sample_rows(conv, 500, seed=2)
    assert len(a) == 500 and set(a) <= set(conv)
    with pytest.raises(ValueError):
        sample_rows([], 3, seed=0)


# --- build_workload -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(datasets_dir, embedded_dir):
    from pdserve.engine.text.tokenizer import Tokenizer
    from pdserve.loadgen.prompt_datasets import load_prompts
    from pdserve.loadgen.prompts import PromptPool

    return PromptPool(load_prompts(["sharegpt", "belle-zh"], datasets_dir), Tokenizer.from_folder(embedded_dir), 0)


def test_build_workload_ties_schedule_lengths_and_prompts(conv, pool):
    rows = scale_to_rate(window(conv, start_s=300.0, max_requests=40), 8.0)
    arrivals = [r.t_s for r in rows]
    lengths = [clip_lengths(r.input_tokens, r.output_tokens, 2048, length_scale=0.5) for r in rows]
    specs = build_workload(arrivals, lengths, pool, seed=11)
    assert len(specs) == 40
    for i, (spec, t, (inp, out)) in enumerate(zip(specs, arrivals, lengths)):
        assert isinstance(spec, RequestSpec) and spec.index == i
        assert spec.send_at_s == t
        assert len(spec.prompt_token_ids) == inp and spec.max_tokens == out
        assert spec.prompt_token_ids[0] == pool.tokenizer.bos_token_id
        assert spec.prompt_source in ("sharegpt", "belle-zh")
    assert {s.prompt_source for s in specs} == {"sharegpt", "belle-zh"}
    assert build_workload(arrivals, lengths, pool, seed=11) == specs
    assert build_workload(arrivals, lengths, pool, seed=12) != specs


def test_build_workload_with_synthetic_arrivals(conv, pool):
    arrivals = gamma_arrivals(5.0, 30, 0.5, seed=2)
    lengths = [clip_lengths(r.input_tokens, r.output_tokens, 1024) for r in sample_rows(conv, 30, seed=2)]
    specs = build_workload(arrivals, lengths, pool, seed=0)
    assert [s.send_at_s for s in specs] == arrivals
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in specs] == lengths


def test_build_workload_rejects(pool):
    with pytest.raises(ValueError, match="2 arrivals but 1 lengths"):
        build_workload([0.0, 1.0], [(3, 3)], pool, seed=0)
    with pytest.raises(ValueError):
        build_workload([0.0, 1.0], [(3, 3), (0, 3)], pool, seed=0)
    with pytest.raises(ValueError):
        build_workload([1.0, 0.5], [(3, 3), (3, 3)], pool, seed=0)


def test_workload_module_imports_neither_torch_nor_ray():
    import subprocess

    code = (
        "import sys, pdserve.loadgen.workload, pdserve.loadgen.prompts; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_datasets_found_from_the_working_directory(tmp_path, monkeypatch):
    """An installed package run from a checkout finds ../shared/datasets or ./shared/datasets."""
    import pdserve.loadgen.dataset_files as dataset_files

    monkeypatch.delenv("PDSERVE_DATASETS", raising=False)
    installed = tmp_path / "venv" / "lib" / "site-packages" / "pdserve" / "loadgen" / "dataset_files.py"
    monkeypatch.setattr(dataset_files, "__file__", str(installed))
    (tmp_path / "shared" / "datasets").mkdir(parents=True)
    checkout = tmp_path / "pdserve"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    assert resolve_datasets_dir() == tmp_path / "shared" / "datasets"
    monkeypatch.chdir(tmp_path)
    assert resolve_datasets_dir() == tmp_path / "shared" / "datasets"
