"""The Azure LLM inference traces: load_trace reads every row of the CSV files, exactly, and says where a
bad row or a missing file is; the datasets folder is found from the package or the working directory."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pdserve.loadgen.dataset_files import resolve_datasets_dir
from pdserve.loadgen.workload import TRACES, TraceRow, load_trace
from tests.loadgen._datasets import DATASETS

DATASET = "azure_llm_trace_2023"  # the datasets_dir fixture (conftest.py) skips when it is absent


def _raw_csv(name: str) -> list[list[str]]:
    with (DATASETS / TRACES[name]).open(newline="") as f:
        return list(csv.reader(f))[1:]


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
