"""``pdserve bench``: replay a trace (or a synthetic arrival process) against a running router."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import signal
import socket
import time
from pathlib import Path

from pdserve.engine.host.cli_args import non_negative_float, non_negative_int, positive_float, positive_int
from pdserve.bench.metrics import SLO, RequestRecord, format_prefix_cache, json_safe, prefix_cache_report, summarize
from pdserve.bench.mooncake import BLOCK_TOKENS
from pdserve.bench.prompts import PROMPT_SETS, RANDOM_PROMPTS, BlockPrompts, make_prompt_pool
from pdserve.bench.workload import (TRACES, RequestSpec, build_workload, clip_lengths, fix_lengths, gamma_arrivals,
                            load_trace, poisson_arrivals, sample_rows, scale_to_rate, window)

DEFAULT_PROMPTS = "sharegpt,belle-zh"


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags that define the requests (shared by bench and compare)."""
    g = p.add_argument_group("workload")
    g.add_argument("--arrival", choices=["trace", "poisson", "gamma"], default="trace",
                   help="trace: the trace's own timestamps (scaled to --rate when given); poisson/gamma: synthetic at --rate")
    g.add_argument("--trace", default=None,
                   help=f"{', '.join(TRACES)}, a CSV path or a Mooncake .jsonl path; also the length source "
                        f"(default azure-conv); mooncake traces also shape shared prompt prefixes")
    g.add_argument("--trace-start", type=non_negative_float, default=0.0, help="window start in the trace, s")
    g.add_argument("--duration", type=positive_float, default=None, help="window length in the trace, s")
    g.add_argument("--num-requests", type=positive_int, default=20, help="requests to send (cut of the window)")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    g.add_argument("--length-scale", type=positive_float, default=1.0, help="multiply trace token counts (fit small hardware)")
    g.add_argument("--max-input-tokens", type=positive_int, default=None)
    g.add_argument("--max-output-tokens", type=positive_int, default=None)
    g.add_argument("--input-len", type=positive_int, default=None,
                   help="every prompt exactly this many tokens (instead of the trace's lengths; not scaled)")
    g.add_argument("--output-len", type=positive_int, default=None,
                   help="every request exactly this many output tokens (instead of the trace's; not scaled)")
    g.add_argument("--prompts", default=None,
                   help=f"comma-separated prompt sets: {', '.join(PROMPT_SETS)}; or {RANDOM_PROMPTS} "
                        f"(random token ids, no dataset needed); default {DEFAULT_PROMPTS}")
    g.add_argument("--datasets-dir", default=None, help="folder with the datasets (default ../shared/datasets)")
    g.add_argument("--seed", type=non_negative_int, default=0)


def add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="TTFT SLO, ms")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=None, help="TPOT SLO, ms")


SYNTHETIC_INPUT_LEN, SYNTHETIC_OUTPUT_LEN, SYNTHETIC_RATE = 256, 64, 1.0


def fall_back_without_datasets(args) -> str | None:
    """Fill in the default trace and prompt sets, unless they would be read from a datasets folder
    that is not there (a fresh install, run from any folder, with no --datasets-dir or
    $PDSERVE_DATASETS) and the user chose neither: then switch ``args`` to a synthetic workload that
    needs no file (Poisson arrivals, random-token prompts, 256 tokens in and 64 out unless given).
    Returns the note to print about that switch, or None. A trace or prompt set the user named is
    never replaced: reading it then fails with a message that says where it was looked for."""
    from pdserve.bench.workload import resolve_datasets_dir

    chose = args.trace is not None or args.prompts is not None
    args.trace = args.trace or "azure-conv"
    args.prompts = args.prompts or DEFAULT_PROMPTS
    if chose or args.datasets_dir is not None or resolve_datasets_dir().is_dir():
        return None
    reads_trace = args.arrival == "trace" or args.input_len is None or args.output_len is None
    if not reads_trace and args.prompts == RANDOM_PROMPTS:
        return None
    if args.arrival == "trace":
        args.arrival = "poisson"
        args.rate = getattr(args, "rate", None) or SYNTHETIC_RATE
    args.prompts = RANDOM_PROMPTS
    args.input_len = args.input_len or SYNTHETIC_INPUT_LEN
    args.output_len = args.output_len or SYNTHETIC_OUTPUT_LEN
    return (f"no datasets folder found (--datasets-dir, $PDSERVE_DATASETS or ../shared/datasets): running a "
            f"synthetic workload instead: {args.arrival} arrivals, random-token prompts of {args.input_len} tokens, "
            f"{args.output_len} output tokens each (trace options such as --length-scale do not apply); name "
            f"--trace/--prompts to insist on a dataset")


def build_specs(args, tokenizer, max_model_len: int, rate: float | None) -> list[RequestSpec]:
    """The request list for one run. The same args give the same lengths and prompts at every rate;
    only the send times change with ``rate`` (req/s).

    ``--input-len``/``--output-len`` fix the lengths exactly; with both and a synthetic arrival
    process the trace is not read, and with ``--prompts random`` no dataset is needed at all. A
    trace with hash ids (Mooncake) builds the prompts from blocks of ``512 * --length-scale``
    tokens (rounded), one per id, so its shared prefixes stay shared."""
    args.trace = args.trace or "azure-conv"
    args.prompts = args.prompts or DEFAULT_PROMPTS
    fixed = args.input_len is not None and args.output_len is not None
    if args.arrival == "trace" or not fixed:
        rows = window(load_trace(args.trace, args.datasets_dir), args.trace_start, args.duration, args.num_requests)
        if not rows:
            raise ValueError(f"the trace window (--trace-start {args.trace_start:g}, --duration {args.duration}) "
                             f"holds no requests")
    if args.arrival == "trace":
        if rate:
            rows = scale_to_rate(rows, rate)
        arrivals = [r.t_s for r in rows]
    else:
        if not rate:
            raise ValueError(f"--arrival {args.arrival} needs --rate")
        n = args.num_requests
        arrivals = (poisson_arrivals(rate, n, args.seed) if args.arrival == "poisson"
                    else gamma_arrivals(rate, n, args.burstiness, args.seed))
        rows = None if fixed else sample_rows(rows, n, args.seed)
    lengths = ([(args.input_len, args.output_len)] * len(arrivals) if rows is None
               else [(r.input_tokens, r.output_tokens) for r in rows])
    if not fixed:
        lengths = [clip_lengths(i, o, max_model_len, args.length_scale, args.max_input_tokens,
                                args.max_output_tokens) for i, o in lengths]
    lengths = fix_lengths(lengths, max_model_len, args.input_len, args.output_len)
    pool = make_prompt_pool(args.prompts, tokenizer, args.seed, args.datasets_dir)
    if rows is None or not any(r.hash_ids for r in rows):
        return build_workload(arrivals, lengths, pool, args.seed)
    blocks = BlockPrompts(pool, max(1, round(BLOCK_TOKENS * args.length_scale)), args.seed)
    return build_workload(arrivals, lengths, blocks, args.seed, [r.hash_ids for r in rows])


def is_loopback(address: str) -> bool:
    """True when ``host:port`` names this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def write_results(out_dir: Path, records: list[RequestRecord], summary: dict) -> None:
    """``results.jsonl`` (one request per line) and ``summary.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json(), allow_nan=False) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))


def print_summary(summary: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, header_style="bold")
    for col in ("metric", "mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    for key, label in (("ttft_s", "TTFT ms"), ("tpot_s", "TPOT ms"), ("itl_s", "ITL ms"), ("e2e_s", "E2E ms")):
        s = summary[key]
        t.add_row(label, *(f"{s[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")))
    console = Console()
    console.print(t)
    line = (f"requests {summary['requests']} (ok {summary['completed']}, failed {summary['failed']}) in "
            f"{summary['duration_s']:.1f}s: {summary['request_throughput']:.2f} req/s, "
            f"{summary['output_token_throughput']:.1f} output tok/s")
    if "goodput" in summary:
        line += (f"; SLO TTFT {summary['slo']['ttft_s'] * 1e3:.0f} ms + TPOT {summary['slo']['tpot_s'] * 1e3:.0f} ms: "
                 f"attainment {summary['slo_attainment'] * 100:.0f}%, goodput {summary['goodput']:.2f} req/s")
    console.print(line)
    if summary.get("kv_transfer_bytes") or summary.get("prefilled_on_decode"):
        console.print(f"KV moved prefill -> decode: {summary['kv_transfer_bytes'] / 1e6:.1f} MB; prefilled on the "
                      f"decode worker (no KV moved): {summary['prefilled_on_decode']} requests; prompt tokens "
                      f"from prefix caches: {summary['cached_prompt_tokens']}", highlight=False)
    console.print(format_prefix_cache(summary.get("prefix_cache")), highlight=False, soft_wrap=True)


async def bench_once(backend, specs: list[RequestSpec], run_id: str, max_duration_s: float,
                     temperature: float = 0.0, progress: bool = True) -> tuple[list[RequestRecord], bool]:
    """Run the load on ``backend`` (a bench.backends.Backend, entered) with a progress bar. Ctrl-C
    stops sending and keeps what finished; returns the records and whether Ctrl-C stopped the run."""
    from rich.progress import Progress

    from pdserve.bench.runner import run_load

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task(f"{run_id}: {len(specs)} requests", total=len(specs))
            records = await run_load(backend, specs, run_id=run_id, max_duration_s=max_duration_s,
                                     temperature=temperature, stop=stop, on_record=lambda _: bar.advance(task))
            failed = [r for r in records if r.error]
            if failed:
                print(f"{len(failed)} of {len(records)} requests failed; first error: {failed[0].error}")
            return records, stop.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def make_backend(args):
    """The Backend ``--backend`` names, at ``--router`` (grpc) or ``--url`` (openai)."""
    import os

    from pdserve.bench.backends import GrpcBackend, OpenAIBackend
    from pdserve.engine.host.auth import API_KEY_ENV

    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.backend == "openai":
        if not args.url:
            raise SystemExit("--backend openai needs --url http://HOST:PORT")
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


def cmd_bench(args) -> int:
    from urllib.parse import urlsplit

    from pdserve.engine.text.tokenizer import Tokenizer

    target = args.url if args.backend == "openai" else args.router
    host_port = f"{urlsplit(target).hostname}:0" if args.backend == "openai" and target else target
    if target and not is_loopback(host_port) and not args.allow_remote:
        raise SystemExit(f"refusing to load-test non-loopback address {target} (pass --allow-remote)")

    note = fall_back_without_datasets(args)
    if note:
        print(note, flush=True)

    async def main() -> int:
        async with make_backend(args) as backend:
            info = await backend.info()
            tokenizer = Tokenizer.from_folder(args.tokenizer or tokenizer_folder(info.model))
            max_model_len = info.max_model_len or tokenizer.model_max_length
            specs = build_specs(args, tokenizer, max_model_len, args.rate)
            kind = backend.name if info.placement == backend.name else f"{info.placement}, {backend.name}"
            before = await backend.prefix_counters()
            print(f"sending {len(specs)} requests to {target} ({kind}) over "
                  f"{specs[-1].send_at_s:.1f}s; Ctrl-C stops and keeps partial results", flush=True)
            t0 = time.perf_counter()
            records, interrupted = await bench_once(backend, specs, "bench", args.max_duration, args.temperature)
            elapsed = time.perf_counter() - t0
            prefix_cache = prefix_cache_report(before, await backend.prefix_counters())
        slo = (SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
               if args.slo_ttft_ms is not None and args.slo_tpot_ms is not None else None)
        summary = summarize(records, slo, duration_s=elapsed if interrupted else None)
        summary.update(placement=info.placement, model=info.model, rate=args.rate, sent=len(records),
                       scheduled=len(specs), interrupted=interrupted, arrival=args.arrival, prompts=args.prompts,
                       backend=backend.name, target=target, prefix_cache=prefix_cache)
        write_results(Path(args.out), records, summary)
        rate = f"{args.rate:g} req/s" if args.rate else "the trace's own rate"
        print_summary(summary, f"{info.placement} @ {rate}")
        print(f"results: {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'summary.json'}")
        if interrupted:
            print("interrupted: partial results")
            return 130
        return 0 if summary["failed"] == 0 else 1

    return asyncio.run(main())


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="open-loop load test of a running router (trace replay or synthetic)")
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                   help="grpc: pdserve's gRPC API at --router; openai: any OpenAI-compatible server at --url "
                        "(streaming /v1/completions, token-id prompts, ignore_eos)")
    p.add_argument("--router", default="127.0.0.1:50051", help="router host:port (--backend grpc)")
    p.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (--backend openai)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY)")
    p.add_argument("--served-model", default=None,
                   help="model id to send (--backend openai; default: the first of GET /v1/models)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback router address")
    p.add_argument("--rate", type=positive_float, default=None, help="mean request rate, req/s (trace: rescales its timestamps)")
    p.add_argument("--tokenizer", default=None,
                   help="model folder for the tokenizer (default: the folder the served model's id "
                        "names here: an embedded or GGUF model, or a folder path)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-duration", type=positive_float, default=600.0, help="hard stop for the run, s")
    p.add_argument("--out", default=f"bench_results/{time.strftime('%Y%m%d-%H%M%S')}")
    add_workload_args(p)
    add_slo_args(p)
    p.set_defaults(func=cmd_bench)
