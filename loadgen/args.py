"""The workload flags of ``pdserve bench`` and ``pdserve compare`` and the request list they define."""

from __future__ import annotations

import argparse

from pdserve.loadgen.metrics import SLO
from pdserve.loadgen.mooncake import BLOCK_TOKENS
from pdserve.loadgen.prompt_datasets import PROMPT_SETS
from pdserve.loadgen.prompts import RANDOM_PROMPTS, BlockPrompts, make_prompt_pool, prompt_set_names
from pdserve.loadgen.workload import (
    TRACES,
    RequestSpec,
    build_workload,
    clip_lengths,
    fix_lengths,
    gamma_arrivals,
    load_trace,
    poisson_arrivals,
    sample_conversations,
    sample_rows,
    scale_to_rate,
    window,
)
from pdserve.worker.flags import non_negative_float, non_negative_int, positive_float, positive_fraction, positive_int

DEFAULT_PROMPTS = "sharegpt,belle-zh"


def prompt_sets(text: str) -> str:
    """argparse type for ``--prompts``: comma-separated prompt-set names, or ``random`` alone,
    checked before anything is read (:func:`pdserve.loadgen.prompts.prompt_set_names`); returns
    them joined by commas without blanks."""
    try:
        return ",".join(prompt_set_names(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags that define the requests (shared by bench and compare)."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--arrival",
        choices=["trace", "poisson", "gamma"],
        default=None,
        help="trace: the trace's own timestamps (scaled to --rate when given); poisson/gamma: "
        "synthetic at --rate; default trace, or poisson when no datasets folder is found and "
        "neither --trace nor a prompt set is named (a synthetic workload)",
    )
    g.add_argument(
        "--trace",
        default=None,
        help=f"{', '.join(TRACES)}, a CSV path or a Mooncake .jsonl path; also the length source "
        f"(default azure-conv); mooncake traces also shape shared prompt prefixes",
    )
    g.add_argument("--trace-start", type=non_negative_float, default=0.0, help="window start in the trace, s")
    g.add_argument("--duration", type=positive_float, default=None, help="window length in the trace, s")
    g.add_argument("--num-requests", type=positive_int, default=20, help="requests to send (cut of the window)")
    g.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape; 1 = Poisson, < 1 burstier")
    g.add_argument(
        "--conversation-sample",
        type=positive_fraction,
        default=None,
        metavar="RATE",
        help="Mooncake: keep this fraction of conversations, all their turns (hashed, --seed), "
        "before the window; a short run keeps the trace's prefix reuse",
    )
    g.add_argument(
        "--length-scale", type=positive_float, default=1.0, help="multiply trace token counts (fit small hardware)"
    )
    g.add_argument("--max-input-tokens", type=positive_int, default=None)
    g.add_argument("--max-output-tokens", type=positive_int, default=None)
    g.add_argument(
        "--input-len",
        type=positive_int,
        default=None,
        help="every prompt exactly this many tokens (instead of the trace's lengths; not scaled)",
    )
    g.add_argument(
        "--output-len",
        type=positive_int,
        default=None,
        help="every request exactly this many output tokens (instead of the trace's; not scaled)",
    )
    g.add_argument(
        "--prompts",
        type=prompt_sets,
        default=None,
        help=f"comma-separated prompt sets: {', '.join(PROMPT_SETS)}; or {RANDOM_PROMPTS} "
        f"(random token ids, no dataset needed); default {DEFAULT_PROMPTS}",
    )
    g.add_argument(
        "--datasets-dir",
        default=None,
        help="folder with the datasets (default: ./shared/datasets or ../shared/datasets)",
    )
    g.add_argument("--seed", type=non_negative_int, default=0)


SLO_TOGETHER = "goodput counts the requests that meet both SLOs, so give both or neither"


def add_slo_args(p: argparse.ArgumentParser, needed: bool = False) -> None:
    """``--slo-ttft-ms`` and ``--slo-tpot-ms``; they go together (:func:`slo_from_args`). ``needed``:
    the command refuses to run without them (its help says so; the caller checks)."""
    why = "needed, both: goodput counts the requests that meet both SLOs" if needed else SLO_TOGETHER
    p.add_argument("--slo-ttft-ms", type=positive_float, default=None, help=f"TTFT SLO, ms ({why})")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=None, help=f"TPOT SLO, ms ({why})")


def slo_from_args(args) -> SLO | None:
    """The SLO of ``--slo-ttft-ms`` and ``--slo-tpot-ms`` (milliseconds on the command line, seconds
    in SLO), None when neither is given. Goodput counts the requests that meet *both*
    (:class:`pdserve.loadgen.metrics.SLO`, DistServe's definition), so one without the other is a
    ValueError, raised before any request is sent."""
    ttft, tpot = args.slo_ttft_ms, args.slo_tpot_ms
    if ttft is None and tpot is None:
        return None
    if ttft is None or tpot is None:
        given, missing = ("--slo-ttft-ms", "--slo-tpot-ms") if tpot is None else ("--slo-tpot-ms", "--slo-ttft-ms")
        raise ValueError(f"{given} needs {missing} too: {SLO_TOGETHER}")
    return SLO(ttft / 1e3, tpot / 1e3)


SYNTHETIC_INPUT_LEN, SYNTHETIC_OUTPUT_LEN, SYNTHETIC_RATE = 256, 64, 1.0


def fill_workload_defaults(args) -> None:
    """``--arrival``, ``--trace`` and ``--prompts`` left unset take their defaults (trace arrivals,
    azure-conv, DEFAULT_PROMPTS)."""
    args.arrival = args.arrival or "trace"
    args.trace = args.trace or "azure-conv"
    args.prompts = args.prompts or DEFAULT_PROMPTS


def fall_back_without_datasets(args) -> str | None:
    """Fill in the default arrival process, trace and prompt sets, unless they would be read from a
    datasets folder that is not there (a fresh install, run from any folder, with no --datasets-dir
    or $PDSERVE_DATASETS) and the user named none of them (``--prompts random`` names no dataset):
    then switch ``args`` to a synthetic workload that needs no file (Poisson arrivals, at --rate or
    1 req/s; random-token prompts; 256 tokens in and 64 out unless given). Returns the note to
    print about that switch, or None. A trace, prompt set or ``--arrival trace`` the user named is
    never replaced: reading the file then fails with a message that says where it was looked for
    and what needs it."""
    from pdserve.loadgen.dataset_files import resolve_datasets_dir

    chose = args.trace is not None or args.arrival == "trace" or args.prompts not in (None, RANDOM_PROMPTS)
    fill_workload_defaults(args)
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
    return (
        "no datasets folder found (--datasets-dir, $PDSERVE_DATASETS, ./shared/datasets or "
        f"../shared/datasets): running a synthetic workload instead: {args.arrival} arrivals, "
        f"random-token prompts of {args.input_len} tokens, "
        f"{args.output_len} output tokens each (trace options such as --length-scale do not apply); name "
        f"--trace, --arrival trace or a prompt set to insist on a dataset"
    )


def _load_trace(args):
    """The rows of ``--trace``; its FileNotFoundError also says what needs the trace and how to do
    without it."""
    try:
        return load_trace(args.trace, args.datasets_dir)
    except FileNotFoundError as exc:
        needs = []
        if args.arrival == "trace":
            needs.append(
                "its arrival times (--arrival trace, the default; --arrival poisson with --rate needs no trace)"
            )
        if args.input_len is None or args.output_len is None:
            needs.append("its request lengths (--input-len with --output-len needs no trace)")
        raise FileNotFoundError(f"{exc}. The trace {args.trace} is read for {' and '.join(needs)}") from None


def check_trace(args) -> None:
    """Read ``--trace`` now when the run will need it (as ``build_specs`` decides), so that a
    missing or malformed file is reported before any connection: FileNotFoundError or ValueError,
    as ``load_trace`` raises them."""
    fill_workload_defaults(args)
    if args.arrival == "trace" or args.input_len is None or args.output_len is None:
        _load_trace(args)


def build_specs(args, tokenizer, max_model_len: int, rate: float | None) -> list[RequestSpec]:
    """The request list for one run. The same args give the same lengths and prompts at every rate;
    only the send times change with ``rate`` (req/s).

    ``--input-len``/``--output-len`` fix the lengths exactly; with both and a synthetic arrival
    process the trace is not read, and with ``--prompts random`` no dataset is needed at all. A
    trace with hash ids (Mooncake) builds the prompts from blocks of ``512 * --length-scale``
    tokens (rounded), one per id, so its shared prefixes stay shared."""
    fill_workload_defaults(args)
    fixed = args.input_len is not None and args.output_len is not None
    if args.arrival == "trace" or not fixed:
        rows = sample_conversations(_load_trace(args), args.conversation_sample, args.seed)
        if not rows and args.conversation_sample is not None:
            raise ValueError(
                f"--conversation-sample {args.conversation_sample:g} (--seed {args.seed}) kept no "
                f"requests of the trace; take a larger fraction"
            )
        rows = window(rows, args.trace_start, args.duration, args.num_requests)
        if not rows:
            raise ValueError(
                f"the trace window (--trace-start {args.trace_start:g}, --duration {args.duration}) holds no requests"
            )
    if args.arrival == "trace":
        if rate:
            rows = scale_to_rate(rows, rate)
        arrivals = [r.t_s for r in rows]
    else:
        if not rate:
            raise ValueError(f"--arrival {args.arrival} needs --rate")
        n = args.num_requests
        arrivals = (
            poisson_arrivals(rate, n, args.seed)
            if args.arrival == "poisson"
            else gamma_arrivals(rate, n, args.burstiness, args.seed)
        )
        rows = None if fixed else sample_rows(rows, n, args.seed)
    lengths = (
        [(args.input_len, args.output_len)] * len(arrivals)
        if rows is None
        else [(r.input_tokens, r.output_tokens) for r in rows]
    )
    if not fixed:
        lengths = [
            clip_lengths(i, o, max_model_len, args.length_scale, args.max_input_tokens, args.max_output_tokens)
            for i, o in lengths
        ]
    lengths = fix_lengths(lengths, max_model_len, args.input_len, args.output_len)
    pool = make_prompt_pool(args.prompts, tokenizer, args.seed, args.datasets_dir)
    if rows is None or not any(r.hash_ids for r in rows):
        return build_workload(arrivals, lengths, pool, args.seed)
    blocks = BlockPrompts(pool, max(1, round(BLOCK_TOKENS * args.length_scale)), args.seed)
    return build_workload(arrivals, lengths, blocks, args.seed, [r.hash_ids for r in rows])
