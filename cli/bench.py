"""``pdserve bench``: replay a trace (or a synthetic arrival process) against a running router."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.cli.out_dir import drops_empty_out, prepare_out_dir
from pdserve.loadgen.args import (
    add_slo_args,
    add_workload_args,
    build_specs,
    check_trace,
    fall_back_without_datasets,
    slo_from_args,
)
from pdserve.loadgen.metrics import LATENCY_METRICS, RequestRecord, json_safe, prefix_reuse_ceiling, summarize
from pdserve.loadgen.prefix_cache import format_prefix_cache, prefix_cache_report
from pdserve.loadgen.workload import RequestSpec
from pdserve.worker.flags import host_port, non_negative_float, positive_float


def is_loopback(address: str) -> bool:
    """True when ``host:port`` names this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def http_url(text: str) -> str:
    """argparse type for ``--url``: an ``http://HOST[:PORT]`` or ``https://HOST[:PORT]`` base URL."""
    try:
        parts = urlsplit(text)
        _ = parts.port  # ValueError for a port that is no number in 0..65535
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid URL {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"invalid URL {text!r}: expected http://HOST:PORT or https://HOST:PORT, e.g. http://127.0.0.1:8000"
        )
    return text


def first_errors(records: Sequence[RequestRecord], limit: int = 3) -> list[str]:
    """The first ``limit`` distinct reasons the failed ``records`` give, in request order (the
    error, else the finish reason)."""
    reasons = (r.error or f"finished with reason {r.finish_reason or 'none'!r}" for r in records if not r.ok)
    return list(dict.fromkeys(reasons))[:limit]


def write_results(out_dir: Path, records: list[RequestRecord], summary: dict) -> None:
    """``results.jsonl`` (one request per line) and ``summary.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), allow_nan=False) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))


def print_summary(summary: dict, title: str, errors: Sequence[str] = ()) -> None:
    """The latency table and throughput line of a run; when no request succeeded, one line that
    says so with ``errors`` (the first reasons, :func:`first_errors`) instead."""
    from rich.console import Console
    from rich.table import Table

    if not summary["completed"]:
        line = (
            f"{title}: no request succeeded ({summary['failed']} of {summary['requests']} failed)"
            if summary["requests"]
            else f"{title}: no request was sent"
        )
        if errors:
            line += f"; first error{'s' if len(errors) > 1 else ''}: {' | '.join(errors)}"
        Console().print(line, highlight=False, markup=False, soft_wrap=True)
        return
    t = Table(title=title, header_style="bold")  # each cell is the summary key <row>_<column>, in ms
    for col in ("metric", "mean_ms", "p50_ms", "p90_ms", "p99_ms"):
        t.add_column(col, justify="right")
    for name in LATENCY_METRICS:
        t.add_row(name, *(f"{summary[f'{name}_{k}_s'] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")))
    console = Console()
    console.print(t)
    line = (
        f"requests {summary['requests']} (completed {summary['completed']}, failed {summary['failed']}), "
        f"duration_s {summary['duration_s']:.1f}: request_throughput_rps {summary['request_throughput_rps']:.2f}, "
        f"output_tokens_per_s {summary['output_tokens_per_s']:.1f}"
    )
    if "goodput_rps" in summary:
        line += (
            f"; slo_ttft_ms {summary['slo_ttft_s'] * 1e3:.0f}, slo_tpot_ms {summary['slo_tpot_s'] * 1e3:.0f}: "
            f"slo_attainment {summary['slo_attainment'] * 100:.0f}%, goodput_rps {summary['goodput_rps']:.2f}"
        )
    console.print(line)
    if summary.get("kv_transfer_bytes") or summary.get("prefilled_on_decode"):
        console.print(
            f"KV moved prefill -> decode: {summary['kv_transfer_bytes'] / 1e6:.1f} MB; prefilled on the "
            f"decode worker (no KV moved): {summary['prefilled_on_decode']} requests; prompt tokens "
            f"from prefix caches: {summary['cached_prompt_tokens']}",
            highlight=False,
        )
    console.print(format_prefix_cache(summary.get("prefix_cache")), highlight=False, soft_wrap=True)


async def bench_once(
    backend,
    specs: list[RequestSpec],
    run_id: str,
    max_duration_s: float,
    temperature: float = 0.0,
    progress: bool = True,
) -> tuple[list[RequestRecord], bool]:
    """Run the load on ``backend`` (a pdserve.loadgen.targets.Backend, entered) with a progress bar. Ctrl-C
    stops sending and keeps what finished; returns the records and whether Ctrl-C stopped the run."""
    from rich.progress import Progress

    from pdserve.loadgen.runner import run_load

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"{run_id}: {len(specs)} requests", total=len(specs))
            records = await run_load(
                backend,
                specs,
                run_id=run_id,
                max_duration_s=max_duration_s,
                temperature=temperature,
                stop=stop,
                on_record=lambda _: bar.advance(task),
            )
            failed = [r for r in records if r.error]
            if failed:
                print(f"{len(failed)} of {len(records)} requests failed; first error: {failed[0].error}")
            return records, stop.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def make_backend(args):
    """The Backend ``--backend`` names, at ``--router`` (grpc) or ``--url`` (openai)."""
    import os

    from pdserve.loadgen.targets import GrpcBackend, OpenAIBackend
    from pdserve.rpc.auth import API_KEY_ENV

    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.backend == "openai":
        if not args.url:
            raise ValueError("--backend openai needs --url http://HOST:PORT")
        return OpenAIBackend(args.url, args.served_model, args.api_key)
    return GrpcBackend(args.router, args.api_key)


def tokenizer_folder(served: str) -> str:
    """A local folder with the tokenizer of the model a server reports (pdserve: its id; vLLM: its
    ``root``, often a path): that folder when it is one here, else the embedded model or the GGUF
    conversion the id names (cached on this machine, or built). SystemExit asking for
    ``--tokenizer`` otherwise (pdserve never shows its model's path to clients)."""
    from pdserve.engine.models.embedded import resolve_embedded
    from pdserve.engine.models.gguf import resolve_gguf

    if Path(served).expanduser().is_dir():
        return served
    try:
        found = resolve_embedded(served) or resolve_gguf(served)
    except FileNotFoundError:
        found = None
    if found is None:
        raise SystemExit(f"the server serves {served!r}, which names no model folder here; pass --tokenizer FOLDER")
    return str(found)


@drops_empty_out
def cmd_bench(args) -> int:
    from pdserve.engine.text.tokenizer import Tokenizer

    target = args.url if args.backend == "openai" else args.router
    host_port = f"{urlsplit(target).hostname}:0" if args.backend == "openai" and target else target
    if target and not is_loopback(host_port) and not args.allow_remote:
        raise ValueError(f"refusing to load-test non-loopback address {target} (pass --allow-remote)")
    slo = slo_from_args(args)
    out = prepare_out_dir(args.out)  # before any request: a folder that cannot be written loses no run

    note = fall_back_without_datasets(args)
    if note:
        print(note, flush=True)
    check_trace(args)  # a missing or malformed trace is named before the router is dialled

    async def main() -> int:
        async with make_backend(args) as backend:
            info = await backend.info()
            tokenizer = Tokenizer.from_folder(args.tokenizer or tokenizer_folder(info.model))
            max_model_len = info.max_model_len or tokenizer.model_max_length
            specs = build_specs(args, tokenizer, max_model_len, args.rate)
            kind = backend.name if info.placement == backend.name else f"{info.placement}, {backend.name}"
            before = await backend.prefix_counters()
            print(
                f"sending {len(specs)} requests to {target} ({kind}) over "
                f"{specs[-1].send_at_s:.1f}s; Ctrl-C stops and keeps partial results",
                flush=True,
            )
            t0 = time.perf_counter()
            records, interrupted = await bench_once(backend, specs, "bench", args.max_duration, args.temperature)
            elapsed = time.perf_counter() - t0
            prefix_cache = prefix_cache_report(before, await backend.prefix_counters())
            if prefix_cache is not None:
                prefix_cache["ceiling"] = prefix_reuse_ceiling([s.prompt_token_ids for s in specs])
        summary = summarize(records, slo, duration_s=elapsed if interrupted else None)
        summary.update(
            placement=info.placement,
            model=info.model,
            rate_rps=args.rate,
            sent=len(records),
            scheduled=len(specs),
            interrupted=interrupted,
            arrival=args.arrival,
            prompts=args.prompts,
            backend=backend.name,
            target=target,
            prefix_cache=prefix_cache,
        )
        write_results(out, records, summary)
        rate = f"{args.rate:g} req/s" if args.rate else "the trace's own rate"
        print_summary(summary, f"{info.placement} @ {rate}", first_errors(records))
        print(f"results: {out / 'results.jsonl'}, {out / 'summary.json'}")
        if interrupted:
            print("interrupted: partial results")
            return 130
        return 0 if summary["failed"] == 0 else 1

    return asyncio.run(main())


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="open-loop load test of a running router (trace replay or synthetic)")
    p.add_argument(
        "--backend",
        choices=["grpc", "openai"],
        default="grpc",
        help="grpc: pdserve's gRPC API at --router; openai: any OpenAI-compatible server at --url "
        "(streaming /v1/completions, token-id prompts, ignore_eos)",
    )
    p.add_argument("--router", type=host_port, default="127.0.0.1:50051", help="router host:port (--backend grpc)")
    p.add_argument(
        "--url",
        type=http_url,
        default=None,
        help="server base URL, http(s)://HOST:PORT, e.g. http://127.0.0.1:8000 (--backend openai)",
    )
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY)")
    p.add_argument(
        "--served-model", default=None, help="model id to send (--backend openai; default: the first of GET /v1/models)"
    )
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback router address")
    p.add_argument(
        "--rate", type=positive_float, default=None, help="mean request rate, req/s (trace: rescales its timestamps)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder for the tokenizer (default: the folder the served model's id "
        "names here: an embedded or GGUF model, or a folder path)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--max-duration", type=positive_float, default=600.0, help="hard stop for the run, s")
    p.add_argument(
        "--out",
        default=f"bench_results/{time.strftime('%Y%m%d-%H%M%S')}",
        help="folder for results.jsonl and summary.json; created and checked before any request",
    )
    add_workload_args(p)
    add_slo_args(p)
    p.set_defaults(func=cmd_bench)
