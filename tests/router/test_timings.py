"""TTFT, TPOT, ITL and E2E latency have one definition: the client's results and the load generator's
records give the same values for the same timestamps."""

from __future__ import annotations

import math

import pytest

from pdserve.loadgen.metrics import RequestRecord
from pdserve.router.client import GenerationResult
from pdserve.router.timings import RequestTiming

METRICS = ("ttft_s", "tpot_s", "e2e_s", "itl_s", "output_tokens")


def record(sent_s: float, token_times_s: list[float]) -> RequestRecord:
    return RequestRecord(
        index=0,
        request_id="r",
        scheduled_s=sent_s,
        sent_s=sent_s,
        prompt_tokens=4,
        max_tokens=len(token_times_s),
        token_times_s=token_times_s,
        finish_reason="length",
    )


def test_client_and_load_generator_share_the_definitions():
    for name in METRICS:
        definition = getattr(RequestTiming, name)
        assert getattr(GenerationResult, name) is definition, name
        assert getattr(RequestRecord, name) is definition, name


@pytest.mark.parametrize(
    "sent,times",
    [
        (100.0, [100.25, 100.3, 100.3, 100.7]),  # two tokens in one stream message
        (5.0, [5.5, 5.75]),
        (1.0, [1.125]),  # one token: no TPOT
        (2.0, []),  # no token
    ],
)
def test_client_and_load_generator_give_identical_values(sent, times):
    client = GenerationResult(token_ids=list(range(len(times))), sent_s=sent, token_times_s=list(times))
    loadgen = record(sent, list(times))
    for name in METRICS:
        a, b = getattr(client, name), getattr(loadgen, name)
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), name


def test_the_definitions_in_seconds():
    r = RequestTiming(sent_s=10.0, token_times_s=[10.5, 10.5, 10.75, 11.25])
    assert r.ttft_s == 0.5 and r.e2e_s == 1.25
    assert r.tpot_s == pytest.approx((1.25 - 0.5) / 3)  # (E2E - TTFT) / (output tokens - 1)
    assert r.itl_s == [0.0, 0.25, 0.5]
    one = RequestTiming(sent_s=0.0, token_times_s=[0.25])
    assert one.ttft_s == one.e2e_s == 0.25 and math.isnan(one.tpot_s) and one.itl_s == []
    none = RequestTiming()
    assert math.isnan(none.ttft_s) and math.isnan(none.e2e_s) and math.isnan(none.tpot_s)


def test_the_client_keeps_the_names_its_printers_read():
    res = GenerationResult(sent_s=1.0, token_times_s=[1.5, 2.0, 2.5])
    assert (res.sent_at, res.token_times, res.ttft, res.tpot) == (1.0, [1.5, 2.0, 2.5], 0.5, 0.5)
