"""``pdserve generate``: stream one completion from a running router to the terminal.

The completion's text goes to stdout as it arrives; its finish reason, token counts, TTFT and TPOT
go to stderr once it ends.
"""

from __future__ import annotations

import asyncio
import sys

from pdserve.cli.serve import DEFAULT_PORT
from pdserve.worker.flags import host_port, non_negative_int, port, positive_float, positive_int


def cmd_generate(args) -> int:
    import grpc

    from pdserve.router.client import Client, make_request

    async def run() -> int:
        req = make_request(
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        async with Client(args.router or f"127.0.0.1:{args.port}", args.api_key, args.tls_ca) as client:
            try:
                res = await client.generate(
                    req, timeout=args.timeout, on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush())
                )
            except grpc.aio.AioRpcError as exc:
                print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 2
        print()
        if res.error:
            print(f"error: {res.error}", file=sys.stderr)
            return 1
        tpot = f", TPOT {res.tpot_s * 1e3:.1f} ms" if len(res.token_ids) > 1 else ""
        print(
            f"[{res.finish_reason}] prompt {res.prompt_tokens} tokens, output {len(res.token_ids)} tokens, "
            f"TTFT {res.ttft_s * 1e3:.1f} ms{tpot}",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(run())


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream one completion from a running router")
    p.add_argument("prompt")
    p.add_argument("--router", type=host_port, default=None, help="router host:port (default 127.0.0.1:--port)")
    p.add_argument("--port", type=port, default=DEFAULT_PORT)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=non_negative_int, default=None)
    p.add_argument("--seed", type=non_negative_int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM certificate to trust: reach the router over TLS")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds")
    p.set_defaults(func=cmd_generate)
