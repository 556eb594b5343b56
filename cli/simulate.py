"""``pdserve simulate``: run a workload through a simulated cluster on a virtual clock, with the
step times of a profile (``pdserve profile``), and write the summary ``pdserve bench`` writes.

This module stays torch-free at import (``pdserve --help`` builds every parser); the simulator
(``pdserve.planner.simulate``) is imported when the command runs.
"""

from __future__ import annotations

import json
import math
import time

from pdserve.cli.out_dir import drops_empty_out
from pdserve.cli.serve import add_routing_args
from pdserve.loadgen.args import add_slo_args, add_workload_args
from pdserve.worker.flags import non_negative_float, non_negative_int, positive_float, positive_int


def add_simulate_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a cluster on a virtual clock with a profile's step times; write bench's summary",
        description="Run a workload through simulated workers: real engines (scheduler, KV blocks, prefix cache) "
        "whose steps take the profile's predicted time, routed by the router's own policies.",
    )
    p.add_argument("--profile", required=True, help="profile JSON written by pdserve profile")
    p.add_argument("--placement", choices=["split", "colocated", "auto"], default="split")
    p.add_argument("--prefill", type=non_negative_int, default=1, help="prefill workers (split; auto: first roles)")
    p.add_argument(
        "--decode", type=positive_int, default=1, help="decode workers (split); colocated runs prefill+decode workers"
    )
    add_worker_size_args(p)
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="max sequences per step")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="token budget of one step")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false")
    p.add_argument("--target-itl-ms", type=positive_float, default=None, help="as pdserve serve")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    add_routing_args(p)
    p.add_argument(
        "--relay-ms", type=non_negative_float, default=0.0, help="relay time of each token beyond the profile's, ms"
    )
    add_host_cores_arg(p)
    p.add_argument("--rate", type=positive_float, default=None, help="mean request rate, req/s")
    p.add_argument("--out", default=f"sim_results/{time.strftime('%Y%m%d-%H%M%S')}", help="results folder")
    add_workload_args(p)
    add_slo_args(p)
    p.set_defaults(func=cmd_simulate)


def add_worker_size_args(p) -> None:
    """The simulated workers' KV cache and request bound, as ``pdserve serve`` takes them (simulate
    and plan)."""
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None, help="KV blocks per worker")
    p.add_argument("--kv-cache-gib", type=positive_float, default=0.5, help="KV cache per worker, GiB")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="context window cap, tokens")
    p.add_argument("--max-requests-per-worker", type=non_negative_int, default=512, help="as pdserve serve; 0: none")


def add_host_cores_arg(p) -> None:
    """``--host-cores`` (simulate and plan)."""
    p.add_argument(
        "--host-cores",
        type=non_negative_float,
        default=0.0,
        help="the workers share this many cores with the router and the load generator, as on one machine "
        "(the profile's serving costs decide the router's share); 0 (default): each worker has cores of its own",
    )


def read_profile(path: str) -> tuple:
    """``(StepModel, model spec, dtype, ServingPaths or None, measured)`` of a profile JSON
    (``measured``: ``range_notes``' ranges); ValueError (one line) when it cannot be read or lacks
    what the simulation needs."""
    from pdserve.planner.host_cpu import ServingPaths
    from pdserve.planner.step_model import StepModel

    try:
        with open(path) as f:
            profile = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:  # a profile is UTF-8 JSON
        raise ValueError(f"cannot read --profile {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        model, serving = StepModel.from_profile(profile), ServingPaths.from_profile(profile)
        for section in ("settings", "machine"):
            if not isinstance(profile.get(section), dict):
                raise ValueError(f"profile has no {section!r} section (a JSON object)")
        spec, dtype = profile["settings"]["model_spec"], profile["machine"]["dtype"]
        points = profile.get("points") or {}  # a profile written by hand may hold its fits alone
        measured = (
            max((q["tokens"] + q["cached_tokens"] for q in points.get("prefill", [])), default=math.inf),
            max((q["context"] for q in points.get("decode", [])), default=math.inf),
        )
    except (ValueError, KeyError, TypeError) as exc:
        why = {KeyError: f"no {exc}", TypeError: f"a section of the wrong shape ({exc})"}.get(type(exc), exc)
        raise ValueError(f"--profile {path}: {why}") from None
    return model, str(spec), str(dtype), serving, measured


def range_notes(measured: tuple[float, float], specs: list) -> list[str]:
    """A note for each of the workload's lengths (``specs``: ``RequestSpec``) past what the
    profile measured (``measured``: its longest prompt, cached prefix included, and its longest
    decoding context, tokens): their step times extrapolate the profile's fit."""
    prompt = max((len(s.prompt_token_ids) for s in specs), default=0)
    context = max((len(s.prompt_token_ids) + s.max_tokens for s in specs), default=0)
    how = "their steps' times extrapolate its fit (a longer --time-budget or the flag of that grid measures them)"
    notes = []
    if prompt > measured[0]:
        notes.append(f"note: prompts of up to {prompt} tokens; the profile measured up to {measured[0]:.0f}: {how}")
    if context > measured[1]:
        notes.append(f"note: contexts of up to {context} tokens; the profile decoded up to {measured[1]:.0f}: {how}")
    return notes


def check_fits(sim, specs) -> None:
    """ValueError (one line) when the workload's longest request fits no worker's KV cache: every
    request like it would fail, so the simulation would only count failures."""
    from pdserve.engine.params import SamplingParams

    longest = max(specs, key=lambda r: len(r.prompt_token_ids) + r.max_tokens, default=None)
    if longest is None:
        return
    sampling = SamplingParams(temperature=0.0, max_tokens=longest.max_tokens, ignore_eos=True)
    try:
        sim.workers[0].engine.check_request(list(longest.prompt_token_ids), sampling)
    except ValueError as exc:
        why = f"the workload's longest request cannot run: {exc} (--num-kv-blocks, --kv-cache-gib)"
        raise ValueError(why) from None


@drops_empty_out
def cmd_simulate(args) -> int:
    from pdserve.cli.bench import first_errors, print_summary, write_results
    from pdserve.cli.out_dir import prepare_out_dir
    from pdserve.cluster.config import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
    from pdserve.engine.config import EngineConfig
    from pdserve.loadgen.args import build_specs, fall_back_without_datasets, slo_from_args
    from pdserve.loadgen.metrics import prefix_reuse_ceiling, summarize
    from pdserve.loadgen.prefix_cache import prefix_cache_report
    from pdserve.planner.simulate import SimConfig, Simulator

    model, spec, dtype, serving, measured = read_profile(args.profile)
    if serving is None:
        print("the profile has no serving section: steps take the engine's time only", flush=True)
    slo = slo_from_args(args)
    engine = EngineConfig(
        model=spec,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.chunked_prefill,
        enable_prefix_caching=args.prefix_caching,
        max_model_len=args.max_model_len,
        target_itl_ms=args.target_itl_ms,
    )
    out = prepare_out_dir(args.out)
    note = fall_back_without_datasets(args)
    if note:
        print(note, flush=True)
    if args.prefill == 0 and args.placement == "split":
        raise ValueError("--prefill 0 needs --placement auto or colocated (the decode workers then prefill themselves)")
    cfg = SimConfig(
        engine,
        args.placement,
        args.prefill,
        args.decode,
        args.routing,
        args.local_prefill_tokens,
        args.max_requests_per_worker,
        args.relay_ms / 1e3,
        args.local_prefill_policy,
        (args.slo_ttft_ms or DEFAULT_SLO_TTFT_MS) / 1e3,
        (args.slo_tpot_ms or DEFAULT_SLO_TPOT_MS) / 1e3,
        args.host_cores,
    )
    try:
        sim = Simulator(cfg, model, dtype, serving)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the profile's model {spec!r}: {exc}") from None
    specs = build_specs(args, sim.tokenizer, sim.max_model_len, args.rate)
    check_fits(sim, specs)
    for note in range_notes(measured, specs):
        print(note, flush=True)
    n = len(sim.workers)
    print(f"simulating {len(specs)} requests on {n} {args.placement} worker{'s' if n != 1 else ''}", flush=True)
    t0 = time.perf_counter()
    records = sim.run(specs)
    wall = time.perf_counter() - t0
    prefix_cache = prefix_cache_report([], sim.prefix_counters())
    prefix_cache["ceiling"] = prefix_reuse_ceiling([s.prompt_token_ids for s in specs], engine.block_size)
    prefix_cache["ceiling_block_size"] = engine.block_size
    summary = summarize(records, slo)
    summary.update(
        placement=args.placement,
        model=spec,
        rate_rps=args.rate,
        sent=len(records),
        scheduled=len(specs),
        interrupted=False,
        arrival=args.arrival,
        prompts=args.prompts,
        backend="simulate",
        target=args.profile,
        prefix_cache=prefix_cache,
        host_cores=args.host_cores,
        serving_costs=serving is not None,
    )
    if sim.roles is not None:
        summary["role_switches"] = [vars(s) for s in sim.roles.switches]
        print(f"role switches: {len(sim.roles.switches)}", *(f"  {vars(s)}" for s in sim.roles.switches), sep="\n")
    write_results(out, records, summary)
    rate = f"{args.rate:g} req/s" if args.rate else "the trace's own rate"
    print_summary(summary, f"simulated {args.placement} @ {rate}", first_errors(records))
    print(f"simulated in {wall:.1f} s wall; results: {out / 'results.jsonl'}, {out / 'summary.json'}")
    return 0 if summary["failed"] == 0 else 1
