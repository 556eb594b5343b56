"""``pdserve compare``: the same requests against colocated and split placements on the same hardware."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.cli.bench import bench_once, is_loopback, write_results
from pdserve.loadgen.args import add_slo_args, add_workload_args, build_specs, fall_back_without_datasets, slo_from_args
from pdserve.loadgen.metrics import SLO, json_safe, read_summary, summarize
from pdserve.loadgen.runner import unloaded_latency
from pdserve.loadgen.targets import GrpcBackend

TABLE_COLUMNS = (  # the summary keys, milliseconds where a summary holds seconds
    "rate_rps",
    "placement",
    "goodput_rps",
    "slo_attainment",
    "ttft_p90_ms",
    "tpot_p90_ms",
    "ttft_mean_ms",
    "tpot_mean_ms",
    "output_tokens_per_s",
    "failed",
)


def table_rows(summaries: dict) -> list[list[str]]:
    """One row per (rate, placement) from summarize() outputs (also ones read back from summary.json)."""
    rows = []
    rates = sorted({r for per in summaries.values() for r in per})
    for rate in rates:
        for placement, per in summaries.items():
            if per.get(rate) is None:
                continue
            s = read_summary(per[rate])
            label = placement + (" (partial)" if s.get("interrupted") else "")
            rows.append(
                [
                    f"{rate:g}",
                    label,
                    f"{s['goodput_rps']:.2f}",
                    f"{s['slo_attainment'] * 100:.0f}%",
                    f"{s['ttft_p90_s'] * 1e3:.0f}",
                    f"{s['tpot_p90_s'] * 1e3:.1f}",
                    f"{s['ttft_mean_s'] * 1e3:.0f}",
                    f"{s['tpot_mean_s'] * 1e3:.1f}",
                    f"{s['output_tokens_per_s']:.1f}",
                    str(s["failed"]),
                ]
            )
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    head = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + "---|" * len(TABLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(r) + " |\n" for r in rows)


def cmd_compare(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.loader import resolve_model_dir
    from pdserve.engine.text.tokenizer import Tokenizer
    from pdserve.loadgen.plots import write_all
    from pdserve.worker.flags import engine_config_from_args

    if args.peer_url and not is_loopback(f"{urlsplit(args.peer_url).hostname}:0"):
        raise SystemExit(f"--peer-url must be a loopback address, got {args.peer_url}")
    console = Console(width=None if sys.stdout.isatty() else 160)
    note = fall_back_without_datasets(args)
    if note:
        console.print(f"[bold]note[/]: {note}")
    out = Path(args.out)
    rates = args.rates
    engine = engine_config_from_args(args, device="cpu")  # the cluster picks each worker's device
    model_dir = resolve_model_dir(engine.model)
    tokenizer = Tokenizer.from_folder(model_dir)
    max_pos = ModelConfig.from_folder(model_dir).max_position_embeddings
    max_model_len = min(engine.max_model_len or max_pos, max_pos)
    slo = slo_from_args(args)
    slo_note = "given on the command line"
    # build every run's requests first: a missing dataset fails before any cluster starts
    workloads = {rate: build_specs(args, tokenizer, max_model_len, rate) for rate in rates}
    runs: dict = {}
    summaries: dict = {}
    unloaded: dict = {}
    interrupted = False
    t_start = time.monotonic()
    for placement in args.placements.split(","):
        if interrupted:
            break
        cfg = ClusterConfig(
            engine=engine,
            placement=placement,
            num_prefill=args.prefill,
            num_decode=args.decode,
            cpus_per_worker=args.cpus_per_worker,
            router_port=0,
            ray_address=args.address,
            device=args.device,
        )
        console.print(
            f"[bold]{placement}[/]: starting {len(cfg.roles)} workers ({', '.join(cfg.roles)}) on {model_dir.name}..."
        )
        with start_cluster(cfg) as cluster:
            ttft0, tpot0 = asyncio.run(_on(lambda: GrpcBackend(cluster.address), unloaded_latency, workloads[rates[0]]))
            unloaded[placement] = {"ttft_s": ttft0, "tpot_s": tpot0}
            console.print(f"  unloaded single request: ttft_ms {ttft0 * 1e3:.1f}, tpot_ms {tpot0 * 1e3:.1f}")
            if slo is None:
                slo = SLO(args.slo_scale * ttft0, args.slo_scale * tpot0)
                slo_note = (
                    f"{args.slo_scale:g} x the unloaded single-request TTFT/TPOT measured on {placement} "
                    f"at the start of the run"
                )
                console.print(
                    f"  SLO: slo_ttft_ms {slo.ttft_s * 1e3:.0f}, slo_tpot_ms {slo.tpot_s * 1e3:.1f} ({slo_note})"
                )
            interrupted = _sweep(
                placement, lambda: GrpcBackend(cluster.address), workloads, slo, args, out, console, runs, summaries
            )
    if args.peer_url and not interrupted:
        from pdserve.loadgen.targets import OpenAIBackend

        label = "peer"
        console.print(f"[bold]{label}[/]: the OpenAI-compatible server at {args.peer_url}")
        interrupted = _sweep(
            label, lambda: OpenAIBackend(args.peer_url), workloads, slo, args, out, console, runs, summaries
        )
    rows = table_rows(summaries)
    table = Table(
        title=f"colocated vs split: {model_dir.name}, {args.prefill}P+{args.decode}D, "
        f"{args.cpus_per_worker} CPU/worker",
        header_style="bold",
    )
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    console.print(f"SLO: slo_ttft_ms {slo.ttft_s * 1e3:.0f}, slo_tpot_ms {slo.tpot_s * 1e3:.1f} ({slo_note})")
    plots = write_all(runs, summaries, out, slo)
    (out / "table.md").write_text(markdown_table(rows))
    (out / "compare.json").write_text(
        json.dumps(
            json_safe(
                {
                    "command": " ".join(["pdserve", *sys.argv[1:]]),
                    "model": str(model_dir),
                    "rates": rates,
                    "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "note": slo_note},
                    "unloaded": unloaded,
                    "summaries": {p: {f"{r:g}": s for r, s in per.items()} for p, per in summaries.items()},
                }
            ),
            indent=2,
        )
    )
    console.print(f"wrote {out / 'table.md'}, {out / 'compare.json'}, " + ", ".join(str(p) for p in plots))
    console.print(
        f"total {time.monotonic() - t_start:.0f}s" + (" (interrupted: partial results)" if interrupted else "")
    )
    return 130 if interrupted else 0


async def _on(open_backend, fn, *args):
    """``fn(backend, *args)`` over ``open_backend()``, opened on this event loop."""
    async with open_backend() as backend:
        return await fn(backend, *args)


def _sweep(
    label: str, open_backend, workloads: dict, slo, args, out: Path, console, runs: dict, summaries: dict
) -> bool:
    """Every rate of ``workloads`` on one server, into ``runs``/``summaries`` under ``label``;
    True when Ctrl-C stopped it."""
    for rate, specs in workloads.items():
        t0 = time.perf_counter()
        records, interrupted = asyncio.run(_on(open_backend, bench_once, specs, f"{label}@{rate:g}", args.max_duration))
        # a stopped run lasted as long as it ran, not until its last finished request
        summary = summarize(records, slo, duration_s=time.perf_counter() - t0 if interrupted else None)
        summary.update(placement=label, rate_rps=rate, interrupted=interrupted)
        runs.setdefault(label, {})[rate] = records
        summaries.setdefault(label, {})[rate] = summary
        write_results(out / label / f"rate_{rate:g}", records, summary)
        console.print(
            f"  rate_rps {rate:g}: goodput_rps {summary['goodput_rps']:.2f}, "
            f"ttft_p90_ms {summary['ttft_p90_s'] * 1e3:.0f}, "
            f"tpot_p90_ms {summary['tpot_p90_s'] * 1e3:.1f}, failed {summary['failed']}"
        )
        if interrupted:
            console.print("[bold]interrupted[/]: this rate is partial; skipping the rest of the sweep")
            return True
    return False


def add_compare_parser(sub) -> None:
    from pdserve.worker.flags import add_engine_args, positive_float, positive_int, rate_list

    p = sub.add_parser("compare", help="A/B colocated vs split placement on the same resources and requests")
    add_engine_args(p)
    p.set_defaults(model="embedded:llama-80m")
    p.add_argument("--placements", default="colocated,split", help="comma-separated, run in this order")
    p.add_argument("--prefill", type=positive_int, default=1, help="split: prefill workers")
    p.add_argument(
        "--decode", type=positive_int, default=1, help="split: decode workers (colocated runs prefill+decode workers)"
    )
    p.add_argument("--cpus-per-worker", type=positive_int, default=1)
    p.add_argument("--address", default=None, help="Ray cluster to use (default: a local instance)")
    p.add_argument(
        "--rates",
        type=rate_list,
        default=[0.5, 1.0, 2.0],
        help="comma-separated request rates to sweep, req/s (default 0.5,1,2)",
    )
    p.add_argument(
        "--slo-scale",
        type=positive_float,
        default=3.0,
        help="default SLOs = this x the unloaded single-request TTFT and TPOT",
    )
    p.add_argument("--max-duration", type=positive_float, default=300.0, help="hard stop per rate, s")
    p.add_argument("--out", default=f"bench_results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument(
        "--peer-url",
        default=None,
        help="also run the same requests against this running OpenAI-compatible server "
        "(http://127.0.0.1:PORT, e.g. vLLM), as a third row of the table and plots",
    )
    add_workload_args(p)
    add_slo_args(p)
    p.set_defaults(length_scale=0.1, max_input_tokens=512, num_requests=20, func=cmd_compare)
