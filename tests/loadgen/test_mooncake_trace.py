"""Mooncake traces: the JSONL loader and tie spreading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.loadgen.mooncake import spread_ties
from pdserve.loadgen.workload import TRACES, TraceRow, load_trace, scale_to_rate, window
from tests.loadgen._datasets import DATASETS

DATASET = "mooncake_fast25_traces"  # the datasets_dir fixture (conftest.py) skips when it is absent


def _raw(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATASETS / TRACES[name]).read_text().splitlines()]


@pytest.mark.parametrize(
    "name,count,span_s", [("mooncake-conversation", 12_031, 3_537.0), ("mooncake-synthetic", 3_993, 1_022.025)]
)
def test_load_trace_mooncake_keeps_every_field(datasets_dir, name, count, span_s):
    rows, raw = load_trace(name, datasets_dir), _raw(name)
    assert len(rows) == len(raw) == count
    assert [(r.input_tokens, r.output_tokens, list(r.hash_ids)) for r in rows] == [
        (d["input_length"], d["output_length"], d["hash_ids"]) for d in raw
    ]
    assert rows[0].t_s == 0.0 and all(b.t_s >= a.t_s for a, b in zip(rows, rows[1:]))
    ms0 = raw[0]["timestamp"]
    bucket_ends = sorted({d["timestamp"] for d in raw})
    following = dict(zip(bucket_ends, bucket_ends[1:] + [None]))
    for r, d in zip(rows, raw):  # each row stays inside its timestamp bucket
        start = (d["timestamp"] - ms0) / 1e3
        end = following[d["timestamp"]]
        assert start <= r.t_s and (end is None or r.t_s < (end - ms0) / 1e3)
    assert rows[-1].t_s >= span_s


def test_conversation_ties_are_spread(conversation):
    assert conversation[1].t_s == pytest.approx(0.3)  # 10 requests at 0 ms, the next bucket at 3,000 ms
    assert len({r.t_s for r in conversation}) == len(conversation)


def test_window_and_rate_keep_hash_ids(conversation):
    w = window(conversation, start_s=60.0, max_requests=30)
    assert [r.hash_ids for r in w] == [r.hash_ids for r in conversation if r.t_s >= 60.0][:30]
    assert [r.hash_ids for r in scale_to_rate(w, 5.0)] == [r.hash_ids for r in w]


def _write(tmp_path: Path, *rows: object) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _row(ms: int, inp: int = 600, out: int = 5, ids: object = (1, 2)) -> dict:
    return {"timestamp": ms, "input_length": inp, "output_length": out, "hash_ids": list(ids)}


def test_load_trace_small_file(tmp_path):
    rows = load_trace(_write(tmp_path, _row(1000), _row(1000, ids=(1, 3)), "", _row(4000, 10, 1, (7,))))
    assert rows == [TraceRow(0.0, 600, 5, (1, 2)), TraceRow(1.5, 600, 5, (1, 3)), TraceRow(3.0, 10, 1, (7,))]


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        "[1, 2]",
        {"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]},
        _row(5, inp=-1),
        _row(5, out=True),
        _row(5, ids=(1,)),
        _row(5, ids=(1, "2")),
        _row(5, ids=(1, -2)),
        _row(0),  # earlier than the row before
    ],
)
def test_load_trace_malformed_rows_give_line_number(tmp_path, bad):
    with pytest.raises(ValueError, match="t.jsonl:2:"):
        load_trace(_write(tmp_path, _row(1), bad, _row(9)))


def test_spread_ties():
    assert spread_ties([0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0]) == [0.0, 1.0, 2.0, 3.0, 4.5, 6.0, 7.5]
    assert spread_ties([1.0, 2.0, 10.0]) == [1.0, 2.0, 10.0]
    assert spread_ties([2.0, 2.0]) == [2.0, 2.0]  # one distinct time: no gap to spread over
    assert spread_ties([]) == []
