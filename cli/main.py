"""The ``pdserve`` command: serve, generate, demo, bench, compare, throughput, profile, simulate, plan, soak.

Each subcommand lives in its own module (``cli/serve.py``, ``cli/generate.py``, ``cli/demo.py``,
``cli/bench.py``, ``cli/compare.py``, ``cli/profile.py``, ``cli/simulate.py``, ``cli/plan.py``, ``soak/trace_soak.py``)
with the function that adds its parser; this module builds the parser from them and dispatches. ``throughput``'s parser
is built here, since ``cli/throughput.py`` loads torch and the parser is built without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.cli.bench import add_bench_parser
from pdserve.cli.compare import add_compare_parser
from pdserve.cli.demo import add_demo_parser
from pdserve.cli.generate import add_generate_parser
from pdserve.cli.plan import add_plan_parser
from pdserve.cli.profile import add_profile_parser
from pdserve.cli.serve import add_serve_parser
from pdserve.cli.simulate import add_simulate_parser
from pdserve.soak.trace_soak import add_soak_parser
from pdserve.worker.flags import add_engine_args, non_negative_int, positive_int


def cmd_throughput(args) -> int:
    import json

    from pdserve.cli.throughput import format_result, run_throughput
    from pdserve.worker.flags import engine_config_from_args

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: no such folder")
    if args.max_model_len is not None and args.input_len + args.output_len > args.max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the context window of "
            f"{args.max_model_len} tokens (--max-model-len)"
        )
    result = run_throughput(
        engine_config_from_args(args), args.num_prompts, args.input_len, args.output_len, seed=args.seed
    )
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_throughput_parser(sub)
    add_profile_parser(sub)
    add_simulate_parser(sub)
    add_plan_parser(sub)
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_compare_parser(sub)
    add_soak_parser(sub)
    parser.set_defaults(subcommands=sub.choices)  # main() reports a stray flag with its command's usage
    return parser


def add_throughput_parser(sub) -> None:
    p = sub.add_parser(
        "throughput", help="offline throughput of one engine (no Ray, no gRPC) beside its hardware bound"
    )
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=256, help="random prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="greedy tokens per prompt, EOS ignored")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=cmd_throughput)


def _rpc_error(args, exc) -> str:
    """One line for a failed call; where the connection itself failed (no router at that address), the
    address tried and what to do. A router that answers UNAVAILABLE (its workers gone) keeps its words."""
    import grpc

    unreachable = exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (exc.details() or "")
    where = getattr(args, "router", None) or f"127.0.0.1:{getattr(args, 'port', 50051)}"
    if unreachable and hasattr(args, "router"):
        hint = "start one with `pdserve serve`, or pass --router HOST:PORT"
        return f"no router answers at {where} ({hint}): {exc.details()}"
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and hasattr(args, "router") and hasattr(args, "timeout"):
        return (
            f"the call to {where} did not finish within --timeout {args.timeout:g} s (DEADLINE_EXCEEDED): raise "
            f"--timeout, or check that a pdserve router listens there"
        )
    return f"{exc.code().name}: {exc.details()}"


def main(argv: list[str] | None = None) -> int:
    """Run a pdserve command. Mistakes a user can fix (bad flags or files, a router that does not
    answer, a cluster that cannot start) print one ``error:`` line and exit 2; Ctrl-C exits 130
    (``serve`` takes it as its normal stop and exits 0)."""
    import grpc

    args, extra = build_parser().parse_known_args(argv)
    if extra:  # argparse would print the top-level usage: show the command's own instead
        args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except grpc.aio.AioRpcError as exc:
        print(f"error: {_rpc_error(args, exc)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
