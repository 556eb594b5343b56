"""``pdserve demo``: a local split cluster, real prompts streamed concurrently, latency figures."""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from rich.console import Console
from rich.live import Live
from rich.table import Table


def demo_prompts() -> list[str]:
    """The packaged demo prompts (English: Vicuna bench; Chinese: MT-Bench-ZH)."""
    return json.loads(resources.files("pdserve.cluster").joinpath("demo_prompts.json").read_text("utf-8"))["prompts"]


def _answers_table(prompts, texts) -> Table:
    table = Table(show_header=True, header_style="bold", expand=True)
    table.add_column("prompt", ratio=2, overflow="fold")
    table.add_column("streamed answer", ratio=3, overflow="fold")
    for p, t in zip(prompts, texts):
        table.add_row(p, t)
    return table


def _figures_table(prompts, results) -> Table:
    table = Table(title="per request", header_style="bold")
    for col in ("#", "prompt tokens", "output tokens", "TTFT ms", "TPOT ms", "finish"):
        table.add_column(col, justify="right")
    for i, r in enumerate(results):
        tpot = f"{r.tpot * 1e3:.1f}" if len(r.token_ids) > 1 else "-"
        table.add_row(str(i + 1), str(r.prompt_tokens), str(len(r.token_ids)), f"{r.ttft * 1e3:.1f}",
                      tpot, r.finish_reason or r.error)
    return table


async def _run(address: str, prompts: list[str], max_tokens: int, console: Console):
    from pdserve.router.client import Client, make_request

    texts = [""] * len(prompts)
    async with Client(address) as client:
        info = await client.model_info()
        console.print(f"model [bold]{info.model}[/] ({info.placement}: "
                      f"{', '.join(f'{w.role}@{w.address}' for w in info.workers)})")

        def appender(i):
            def on_text(t: str) -> None:
                texts[i] += t
            return on_text

        reqs = [make_request(p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
        with Live(_answers_table(prompts, texts), console=console, refresh_per_second=8) as live:
            tasks = [asyncio.create_task(client.generate(r, timeout=300, on_text=appender(i)))
                     for i, r in enumerate(reqs)]
            while not all(t.done() for t in tasks):
                await asyncio.sleep(0.1)
                live.update(_answers_table(prompts, texts))
            live.update(_answers_table(prompts, texts))
        return [t.result() for t in tasks]


def cmd_demo(args) -> int:
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig

    console = Console()
    prompts = demo_prompts()
    t0 = time.monotonic()
    console.print(f"starting a local split cluster (1 prefill + 1 decode worker, "
                  f"{args.cpus_per_worker} CPU each) on model {args.model or 'embedded (random weights)'}...")
    cfg = ClusterConfig(engine=EngineConfig(model=args.model or "embedded"), placement="split",
                        cpus_per_worker=args.cpus_per_worker, router_port=0)
    with start_cluster(cfg) as cluster:
        console.print(f"cluster up in {time.monotonic() - t0:.1f}s; router at {cluster.address}; "
                      f"streaming {len(prompts)} prompts concurrently")
        results = asyncio.run(_run(cluster.address, prompts, args.max_tokens, console))
        console.print(_figures_table(prompts, results))
        ttfts = sorted(r.ttft * 1e3 for r in results)
        tpots = sorted(r.tpot * 1e3 for r in results if len(r.token_ids) > 1)
        console.print(f"mean TTFT {sum(ttfts) / len(ttfts):.1f} ms, mean TPOT "
                      f"{sum(tpots) / max(len(tpots), 1):.1f} ms; shutting down")
    if not args.model:
        console.print("[dim]The embedded model has seeded random weights, so its text is noise; try "
                      "--model <folder of a trained Llama-family model> for real text.[/]")
    console.print(f"done in {time.monotonic() - t0:.1f}s")
    return 0 if all(not r.error for r in results) else 1


def add_demo_parser(sub) -> None:
    from pdserve.engine.host.cli_args import positive_int

    p = sub.add_parser("demo", help="start a local split cluster and stream answers for real prompts")
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded model)")
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--cpus-per-worker", type=positive_int, default=1)
    p.set_defaults(func=cmd_demo)
