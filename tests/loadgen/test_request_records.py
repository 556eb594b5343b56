"""One request's serving metrics on synthetic timestamps (docs/benchmarking.md, "Metric definitions"):
latencies, what counts as ok, the SLO check, and the JSON form."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.loadgen.metrics import SLO, RequestRecord
from tests.loadgen._records import rec


def test_basic_latencies_exclude_first_token_from_tpot():
    r = rec([0.5, 0.6, 0.8, 1.1])
    assert r.output_tokens == 4
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.2)  # (1.1 - 0.5) / 3, not 1.1 / 4
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.ok


def test_latencies_are_relative_to_sent_not_scheduled():
    r = RequestRecord(
        0,
        "a",
        scheduled_s=1.0,
        sent_s=1.25,
        prompt_tokens=3,
        max_tokens=2,
        token_times_s=[2.0, 2.5],
        finish_reason="length",
    )
    assert r.ttft_s == pytest.approx(0.75)
    assert r.e2e_s == pytest.approx(1.25)
    assert r.tpot_s == pytest.approx(0.5)
    assert r.ok


def test_single_token_request_has_no_tpot_but_meets_tpot_slo():
    r = rec([0.3])
    assert r.ttft_s == pytest.approx(0.3) and r.e2e_s == pytest.approx(0.3)
    assert math.isnan(r.tpot_s)
    assert r.itl_s == []
    assert SLO(ttft_s=0.5, tpot_s=0.001).met(r)
    assert not SLO(ttft_s=0.2, tpot_s=0.001).met(r)


def test_no_tokens_gives_nan_and_misses_slo():
    r = rec([], finish="")
    assert r.output_tokens == 0 and not r.ok
    assert math.isnan(r.ttft_s) and math.isnan(r.e2e_s) and math.isnan(r.tpot_s)
    assert r.itl_s == []
    assert not SLO(10.0, 10.0).met(r)
    # an ok finish without tokens is still not a TTFT hit (nan never meets a limit)
    assert not SLO(10.0, 10.0).met(rec([], finish="stop"))


def test_tokens_sharing_an_arrival_time_give_zero_gaps():
    r = rec([0.2, 0.2, 0.2, 0.5, 0.5])
    assert r.itl_s == pytest.approx([0.0, 0.0, 0.3, 0.0])
    assert len(r.itl_s) == r.output_tokens - 1
    assert r.tpot_s == pytest.approx(0.3 / 4)


@pytest.mark.parametrize(
    "finish,error,ok",
    [
        ("stop", "", True),
        ("length", "", True),
        ("abort", "", False),
        ("error", "", False),
        ("", "", False),
        ("stop", "connection reset", False),
    ],
)
def test_ok_definition(finish, error, ok):
    assert rec([0.1, 0.2], finish=finish, error=error).ok is ok


def test_slo_boundaries_are_inclusive():
    r = rec([0.5, 0.7, 0.9])  # ttft .5, tpot .2
    assert SLO(0.5, 0.2 + 1e-12).met(r)
    assert not SLO(0.5 - 1e-9, 1.0).met(r)
    assert not SLO(1.0, 0.2 - 1e-9).met(r)


def test_to_json_round_trip_has_no_nan_tokens():
    r = rec([0.3], index=4, finish="length", queue_s=0.01, prefill_s=0.02)
    d = r.to_json()
    text = json.dumps(d, allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    back = json.loads(text)
    assert back["tpot_s"] is None
    assert back["ttft_s"] == pytest.approx(0.3) and back["e2e_s"] == pytest.approx(0.3)
    assert back["itl_s"] == [] and back["output_tokens"] == 1 and back["ok"] is True
    for key in (
        "index",
        "request_id",
        "scheduled_s",
        "sent_s",
        "prompt_tokens",
        "max_tokens",
        "token_times_s",
        "finish_reason",
        "error",
        "queue_s",
        "prefill_s",
        "kv_transfer_s",
        "decode_s",
    ):
        assert back[key] == getattr(r, key), key
    assert RequestRecord.from_json(back) == r

    full = rec([0.5, 0.6, 0.8, 1.1]).to_json()
    assert json.loads(json.dumps(full, allow_nan=False))["tpot_s"] == pytest.approx(0.2)
    assert full["itl_s"] == pytest.approx([0.1, 0.2, 0.3])
    empty = json.loads(json.dumps(rec([], finish="").to_json(), allow_nan=False))
    assert empty["ttft_s"] is None and empty["e2e_s"] is None and empty["ok"] is False
