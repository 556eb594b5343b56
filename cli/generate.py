"""``pdserve generate``: stream one completion from a running router to the terminal.

The completion's text goes to stdout as it arrives; its finish reason, token counts, TTFT and TPOT
go to stderr once it ends. When stdout's reader goes away (``| head``), it stops quietly with exit status
141, as ``cat`` does. On Ctrl-C, stdout gets a newline if its text ended mid-line, so that
``interrupted`` (stderr) starts a line of its own. Flags are checked against what the request can
carry (the protobuf field's range, UTF-8 text), and a refusal names the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from pdserve.cli.serve import DEFAULT_PORT
from pdserve.router.validation import TOP_K_ALLOWED
from pdserve.worker.flags import host_port, non_negative_float, positive_float

MAX_INT32, MAX_UINT32, MAX_UINT64 = (1 << 31) - 1, (1 << 32) - 1, (1 << 64) - 1


def int_in(low: int, high: int, allowed: str | None = None):
    """argparse type: an integer in [low, high] (the range of the request field it fills). Below
    ``low`` the error says ``allowed`` (default ``>= low``), above ``high`` the whole range."""

    def integer(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {allowed or f'>= {low}'}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return integer


def utf8_text(text: str) -> str:
    """argparse type: text that UTF-8 can carry. Bytes that are not UTF-8 in an argument (a prompt
    file in another encoding, ``$'\\xff'``) reach Python as lone surrogates, as does ``$'\\udcff'``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        at = len(text[: exc.start].encode("utf-8"))
        if 0xDC80 <= ord(bad) <= 0xDCFF:  # a byte the OS gave that does not decode as UTF-8
            what = f"byte 0x{ord(bad) - 0xDC00:02x} at byte {at} is not part of a UTF-8 character"
        else:
            what = f"a lone UTF-16 surrogate U+{ord(bad):04X} at byte {at}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text: {what}; save or pass the text as UTF-8") from None
    return text


def cmd_generate(args) -> int:
    from pdserve.router.client import Client, make_request

    ends_line = [True]  # whether stdout's text so far ends with a newline

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        ends_line[0] = text.endswith("\n")

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
            res = await client.generate(req, timeout=args.timeout, on_text=show)  # a failed call: main() says why
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

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        if not ends_line[0]:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    except BrokenPipeError:  # stdout's reader went away (`pdserve generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at the exit's flush
        return 128 + signal.SIGPIPE  # as cat's exit status reads in the shell


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream one completion from a running router")
    p.add_argument("prompt", type=utf8_text)
    p.add_argument("--router", type=host_port, default=None, help="router host:port (default 127.0.0.1:--port)")
    p.add_argument("--port", type=int_in(1, 65535, "in 1..65535 (the router's port)"), default=DEFAULT_PORT)
    p.add_argument("--max-tokens", type=int_in(1, MAX_UINT32), default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int_in(-1, MAX_INT32, TOP_K_ALLOWED), default=None, help="-1 or 0 disables")
    p.add_argument("--seed", type=int_in(0, MAX_UINT64), default=None)
    p.add_argument("--stop", type=utf8_text, action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM certificate to trust: reach the router over TLS")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds")
    p.set_defaults(func=cmd_generate)
