"""A request that a stop string ends early keeps its phase timings: the worker sends the phases
known at its first token, and the router adds the decode time since (both APIs, every path)."""

from __future__ import annotations

import pytest

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline

PROMPT = "Once upon a time there was a little"


def _histogram_sum(histogram) -> float:
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_sum"))


@pytest.mark.parametrize("placement,local_prefill_tokens", [("split", 0), ("split", 64), ("colocated", 0)])
async def test_a_stop_string_ending_early_keeps_the_timings(embedded_dir, placement, local_prefill_tokens):
    async with (
        local_pipeline(embedded_dir, placement, local_prefill_tokens=local_prefill_tokens) as pipe,
        Client(pipe.address) as client,
    ):
        full = await client.generate(make_request(PROMPT, max_tokens=24, temperature=0, ignore_eos=True))
        assert full.finish_reason == "length" and len(full.token_ids) == 24
        # a stop string a few tokens into the answer: the router ends the request long before the worker would
        stop = full.text[len(full.text) // 3 :][:4]
        assert stop.strip() and full.text.index(stop) < len(full.text) // 2
        metrics = pipe.router.core.metrics
        prefill_before, decode_before = _histogram_sum(metrics.prefill), _histogram_sum(metrics.decode)
        res = await client.generate(make_request(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
        assert res.finish_reason == "stop" and len(res.token_ids) < 24
        t = res.timings
        assert t.prefill_ns > 0 and t.decode_ns > 0 and t.total_ns >= t.queue_ns + t.prefill_ns
        assert t.decode_ns < t.total_ns
        on_decode = placement == "split" and local_prefill_tokens > 0
        assert t.prefilled_on_decode == on_decode
        if placement == "split" and not on_decode:
            assert t.kv_transfer_bytes > 0 and t.kv_transfer_ns > 0
        # the histograms count this request with its real phases, not with zeros
        assert _histogram_sum(metrics.prefill) - prefill_before >= t.prefill_ns / 1e9 * 0.99
        assert _histogram_sum(metrics.decode) - decode_before >= t.decode_ns / 1e9 * 0.99
        assert await pipe.wait_idle() == 0
