"""Admission: more streams than a decode worker steps at once take turns; none stalls."""

from __future__ import annotations

import asyncio
import time

from pdserve.router.client import Client, make_request
from tests.integration._pipeline import local_pipeline


async def test_a_short_request_behind_a_full_decode_batch_is_not_stalled(embedded_dir):
    """6 long streams on a decode worker that steps 4 at a time, then one short request: it ends
    long before the long ones, within a small multiple of its solo time (it used to wait until
    one of them finished)."""
    async with local_pipeline(embedded_dir, "split", max_num_seqs=4) as pipe, Client(pipe.address) as client:
        short = make_request("Once upon a time", max_tokens=12, temperature=0, ignore_eos=True)
        t = time.monotonic()
        solo = await client.generate(short)
        solo_s = time.monotonic() - t
        longs = [asyncio.create_task(client.generate(make_request(f"story {i}", max_tokens=600, temperature=0,
                                                                   ignore_eos=True))) for i in range(6)]
        await asyncio.sleep(0.5)  # all six are decoding
        t = time.monotonic()
        crowded = await client.generate(short)
        crowded_s = time.monotonic() - t
        assert crowded.token_ids == solo.token_ids
        assert not any(task.done() for task in longs), "the long streams should still be running"
        assert crowded_s < 10 * solo_s + 2.0, (crowded_s, solo_s)
        results = await asyncio.gather(*longs)
        assert all(len(r.token_ids) == 600 for r in results)
        assert await pipe.wait_idle() == 0
