"""Bounded waiting: one short request beside more long streams than ``--max-num-seqs``.

One prefill and one decode worker in this process (one torch thread each, as on a 2-core
machine) behind a router with ``--local-prefill-tokens 32``. A short greedy request runs alone,
then again while ``--longs`` streams of ``--long-tokens`` tokens decode on a worker that steps
``--max-num-seqs`` sequences at a time. Prints both runs' TTFT and end-to-end time, where the
crowded one was prefilled and how long it queued, the ratio to its solo time, and the long
streams' own TTFT (none of them should wait for the others either).

    python benchmarks/short_beside_long.py                       # ../shared/models/stories260K-hf
    python benchmarks/short_beside_long.py --model embedded:llama-80m --long-tokens 300
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time
from pathlib import Path

from pdserve.router.client import Client, make_request

DEFAULT_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K-hf"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


async def timed(client: Client, request) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    res = await client.generate(request)
    return res.ttft_s, time.perf_counter() - t0, res


async def main(args: argparse.Namespace) -> None:
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.models.loader import resolve_model_dir

    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        torch_threads=1,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
    )
    model_dir = resolve_model_dir(args.model)
    p, d = await asyncio.gather(prefill.serve(cfg), decode.serve(cfg))
    r = await router.serve(model_dir, prefill=[p.address], decode=[d.address], local_prefill_tokens=32)
    try:
        async with Client(r.address) as client:
            short = make_request(args.short_prompt, max_tokens=args.short_tokens, temperature=0, ignore_eos=True)
            await client.generate(short)  # warm-up
            solo_ttft, solo_e2e, solo = await timed(client, short)
            longs = [
                asyncio.create_task(
                    timed(
                        client,
                        make_request(
                            f"Once upon a time {i}", temperature=0, max_tokens=args.long_tokens, ignore_eos=True
                        ),
                    )
                )
                for i in range(args.longs)
            ]
            await asyncio.sleep(args.delay)
            ttft, e2e, crowded = await timed(client, short)
            assert crowded.token_ids == solo.token_ids, "greedy output changed beside the long streams"
            long_results = await asyncio.gather(*longs)
    finally:
        await r.stop()
        await p.stop()
        await d.stop()
    t = crowded.timings
    print(
        f"CPU: {cpu_model()}; model {model_dir.name}, {args.dtype}; max_num_seqs {args.max_num_seqs}; "
        f"{args.longs} streams of {args.long_tokens} tokens; short: {args.short_tokens} tokens"
    )
    print("| run | TTFT s | e2e s | prefilled on decode | queue s | e2e / solo |")
    print("|---|---|---|---|---|---|")
    print(
        f"| short, alone | {solo_ttft:.3f} | {solo_e2e:.3f} | {solo.timings.prefilled_on_decode} | "
        f"{solo.timings.queue_ns / 1e9:.3f} | 1.00 |"
    )
    print(
        f"| short, beside the long streams | {ttft:.3f} | {e2e:.3f} | {t.prefilled_on_decode} | "
        f"{t.queue_ns / 1e9:.3f} | {e2e / solo_e2e:.2f} |"
    )
    long_ttfts = [x[0] for x in long_results]
    print(
        f"long streams: TTFT median {statistics.median(long_ttfts):.3f} s, max {max(long_ttfts):.3f} s; "
        f"e2e median {statistics.median(x[1] for x in long_results):.1f} s"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else "embedded:llama-80m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--longs", type=int, default=12)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--short-prompt", default="Lily and Ben went to the park.")
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--delay", type=float, default=2.0, help="seconds between the long streams and the short one")
    asyncio.run(main(ap.parse_args()))
