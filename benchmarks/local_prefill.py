"""Conditional disaggregation: where prefilling on the decode worker beats the split path.

One prefill and one decode worker (in this process, one torch thread each, as on a 2-core
machine) and two routers over them: one always splits, one always prefills on the decode worker
(``local_prefill_tokens`` past any prompt). For each prompt length it sends the same greedy
prompts through both, one at a time, while ``--background`` streams decode on the decode worker,
and prints median TTFT per path and the p99 inter-token gap of the background streams during
each path's requests (what a local prefill costs the requests already decoding there). The
default threshold of ``pdserve serve --local-prefill-tokens`` comes from this table.

    python benchmarks/local_prefill.py                       # embedded:llama-80m, bfloat16
    python benchmarks/local_prefill.py --lengths 16 64 256 --repeats 10
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time

from pdserve.loadgen.metrics import percentile
from pdserve.router.client import Client, make_request


async def ttft_s(client: Client, ids: list[int]) -> float:
    """TTFT of one greedy request of ``ids``, seconds (the client's ``GenerationResult.ttft_s``)."""
    res = await client.generate(make_request("", prompt_token_ids=ids, max_tokens=2, temperature=0, ignore_eos=True))
    if res.error or math.isnan(res.ttft_s):
        raise RuntimeError(f"no token arrived: {res.error or res.finish_reason}")
    return res.ttft_s


async def background(client: Client, ids: list[int], gaps: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        last = None
        async for _msg in client.stream(
            make_request("", prompt_token_ids=ids, max_tokens=200, temperature=0, ignore_eos=True)
        ):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                break


async def main(args: argparse.Namespace) -> None:
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.loader import resolve_model_dir

    cfg = EngineConfig(model=args.model, dtype=args.dtype, torch_threads=1, num_kv_blocks=2048)
    model_dir = resolve_model_dir(args.model)
    p, d = await asyncio.gather(prefill.serve(cfg), decode.serve(cfg))
    split = await router.serve(model_dir, prefill=[p.address], decode=[d.address])
    local = await router.serve(model_dir, prefill=[p.address], decode=[d.address], local_prefill_tokens=1 << 30)
    rng = random.Random(0)
    vocab = split.core.vocab_size
    try:
        async with Client(split.address) as cs, Client(local.address) as cl:
            gaps: list[float] = []
            stop = asyncio.Event()
            bg = [
                asyncio.create_task(background(cs, [rng.randrange(vocab) for _ in range(64)], gaps, stop))
                for _ in range(args.background)
            ]
            await asyncio.sleep(2.0)
            print(
                f"{'tokens':>6} {'split ttft_p50_ms':>18} {'local ttft_p50_ms':>18} {'split itl_p99_ms':>17} "
                f"{'local itl_p99_ms':>17}"
            )
            for n in args.lengths:
                row = []
                itl = []
                for client in (cs, cl):
                    await ttft_s(client, [rng.randrange(vocab) for _ in range(n)])  # warm-up
                    gaps.clear()
                    times = [
                        await ttft_s(client, [rng.randrange(vocab) for _ in range(n)]) for _ in range(args.repeats)
                    ]
                    row.append(percentile(times, 50) * 1e3)
                    itl.append(percentile(gaps, 99) * 1e3)
                print(f"{n:>6} {row[0]:>18.1f} {row[1]:>18.1f} {itl[0]:>17.1f} {itl[1]:>17.1f}")
            stop.set()
            for t in bg:
                t.cancel()
            await asyncio.gather(*bg, return_exceptions=True)
    finally:
        for r in (split, local):
            await r.stop()
        for w in (p, d):
            await w.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--background", type=int, default=8, help="streams decoding on the decode worker meanwhile")
    asyncio.run(main(ap.parse_args()))
