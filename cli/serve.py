"""``pdserve serve``: start a cluster and serve gRPC and the OpenAI HTTP API until Ctrl-C.

This module holds the serve subcommand and what it takes to start a cluster from the command line:
the flags every cluster command shares (:func:`add_cluster_args`: engine, placement, worker counts,
router address, routing), their translation into a ``ClusterConfig``, the port check made before any
worker starts, and the startup note about the cluster secret.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys

from pdserve.cluster.flags import add_role_resource_args, check_local_kv_fits
from pdserve.worker.flags import add_engine_args, non_negative_int, port, positive_float, positive_int

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000


def _cluster_config(args):
    from pdserve.cluster.config import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, ClusterConfig
    from pdserve.rpc.auth import API_KEY_ENV, parse_api_keys
    from pdserve.worker.flags import engine_config_from_args

    num_prefill, num_decode = _first_roles(args)
    given = [f for f, v in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)) if v is not None]
    if given and args.placement != "auto":
        raise ValueError(
            f"{' and '.join(given)} set the targets of --placement auto's role switching; add --placement auto"
        )
    return ClusterConfig(
        engine=engine_config_from_args(args, device="cpu"),
        placement=args.placement,
        num_prefill=num_prefill,
        num_decode=num_decode,
        cpus_per_worker=args.cpus_per_worker,
        router_host=args.host,
        router_port=args.port,
        ray_address=args.address,
        device=args.device,
        http_port=getattr(args, "http_port", 0) or None,
        api_keys=parse_api_keys(
            getattr(args, "api_key", None)
            if getattr(args, "api_key", None) is not None
            else os.environ.get(API_KEY_ENV)
        ),
        max_requests_per_worker=getattr(args, "max_requests_per_worker", 0),
        stream_interval=getattr(args, "stream_interval", 1),
        prefill_resource=args.prefill_resource,
        decode_resource=args.decode_resource,
        tls=_tls_files(args),
        routing=args.routing,
        local_prefill_tokens=args.local_prefill_tokens,
        local_prefill_policy=args.local_prefill_policy,
        slo_ttft_ms=args.slo_ttft_ms or DEFAULT_SLO_TTFT_MS,
        slo_tpot_ms=args.slo_tpot_ms or DEFAULT_SLO_TPOT_MS,
    )


def _first_roles(args) -> tuple[int, int]:
    """--prefill/--decode, or for --placement auto with --plan, the plan's best roles (over
    --prefill + --decode workers when either is given, else the plan's count). ValueError for a
    --plan without auto, or an unreadable plan."""
    if args.plan is None:
        return (1 if args.prefill is None else args.prefill), (1 if args.decode is None else args.decode)
    if args.placement != "auto":
        raise ValueError("--plan sets the first roles of --placement auto; add --placement auto")
    import json

    from pdserve.planner.plan import first_roles

    try:
        with open(args.plan) as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"--plan {args.plan}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--plan {args.plan}: not JSON ({exc})") from None
    given = (args.prefill or 0) + (args.decode or 0) or None
    return first_roles(doc, given)


def _tls_files(args) -> tuple[str, str] | None:
    """(cert, key) from --tls-cert/--tls-key: both or neither; ValueError for one, or an unreadable file."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("give both --tls-cert and --tls-key")
    for path in (cert, key):
        with open(path, "rb"):
            pass
    return str(os.path.abspath(cert)), str(os.path.abspath(key))


def check_port_free(host: str, port_number: int, flag: str = "--port") -> None:
    """ValueError naming the port when it is taken (checked before any worker starts)."""
    if port_number == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME-WAIT is no conflict
        try:
            s.bind((host, port_number))
        except OSError as exc:
            # no interface has that address, or the name is no address at all
            host_wrong = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            hint = "--host" if host_wrong else flag
            raise ValueError(f"cannot serve on {host}:{port_number}: {exc.strerror}; pick {hint}") from exc


def add_cluster_args(p: argparse.ArgumentParser, default_port: int = DEFAULT_PORT) -> None:
    from pdserve.cluster.config import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS

    add_engine_args(p)
    p.add_argument(
        "--placement",
        choices=["split", "colocated", "auto"],
        default="split",
        help="auto: switchable workers whose roles the router changes as the load does (docs/architecture.md)",
    )
    p.add_argument("--prefill", type=non_negative_int, default=None, help="prefill workers (default 1; auto: may be 0)")
    p.add_argument(
        "--decode", type=positive_int, default=None, help="decode workers (default 1); colocated runs prefill+decode"
    )
    p.add_argument("--plan", default=None, help="auto: take the first roles from this plan.json (pdserve plan)")
    p.add_argument(
        "--slo-ttft-ms",
        type=positive_float,
        default=None,
        help=f"auto: the TTFT target role switching keeps (ms; default {DEFAULT_SLO_TTFT_MS:g})",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=positive_float,
        default=None,
        help=f"auto: the TPOT target role switching keeps (ms; default {DEFAULT_SLO_TPOT_MS:g})",
    )
    p.add_argument(
        "--cpus-per-worker", type=positive_int, default=1, help="CPUs (and torch threads) per worker without GPUs"
    )
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=port, default=default_port, help="router port (0 = any free port)")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: start a local Ray)")
    add_role_resource_args(p)
    add_routing_args(p)


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """--routing, --local-prefill-tokens and --local-prefill-policy (docs/architecture.md:
    "Prefix-aware routing", "Conditional disaggregation")."""
    from pdserve.cluster.config import DEFAULT_LOCAL_PREFILL_TOKENS
    from pdserve.router.local_prefill import DEFAULT_LOCAL_PREFILL_POLICY, LOCAL_PREFILL_POLICIES
    from pdserve.router.pool import ROUTING_POLICIES

    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="prefix-aware",
        help="prefix-aware: prefer the worker holding the prompt's prefix, balanced against load; "
        "least-loaded: ignore prefixes",
    )
    p.add_argument(
        "--local-prefill-tokens",
        type=non_negative_int,
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        help="split and auto: the decode worker prefills a request itself when at most this many prompt tokens "
        "are not in its prefix cache (no KV moves); 0 = only when the policy's load rule says so",
    )
    p.add_argument(
        "--local-prefill-policy",
        choices=LOCAL_PREFILL_POLICIES,
        default=DEFAULT_LOCAL_PREFILL_POLICY,
        help="prefix: only the rule above; load-aware: also when every prefill worker is behind and the "
        "decode worker has room",
    )


def secret_note() -> str | None:
    """The startup line for a cluster that makes its own secret (no $PDSERVE_CLUSTER_SECRET): it is
    never shown, so say how to choose one that admin tools can carry. None when one is set."""
    from pdserve.rpc.auth import SECRET_ENV, cluster_secret

    if cluster_secret():
        return None
    return (
        f"cluster secret: generated for this run and not shown; to let admin tools use it (pdserve bench's "
        f"per-worker prefix-cache hit rates, the admin model info), export {SECRET_ENV} before serve and for bench"
    )


def cmd_serve(args) -> int:
    from pdserve.cluster.launch import start_cluster

    cfg = _cluster_config(args)
    note = secret_note()  # read before the cluster starts: what start_cluster sees
    if args.http_port and args.http_port == args.port:
        raise ValueError(f"--http-port {args.http_port} is also --port: the gRPC and HTTP servers need a port each")
    if args.address is None:
        check_port_free(args.host, args.port)
        if args.http_port:
            check_port_free(args.host, args.http_port, "--http-port")

    def interrupted(*_):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C would break the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    # torch first, with a signal only noted: a KeyboardInterrupt raised inside its C++ modules'
    # start aborts the process ("terminate called ... pybind11::error_already_set")
    noted = []
    signal.signal(signal.SIGINT, lambda *_: noted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: noted.append(True))
    import pdserve.engine.models.loader  # noqa: F401  (the cluster's start reads the model with it)

    # Ctrl-C or SIGTERM while the cluster starts stops it (start_cluster stops what it started),
    # also where the shell started serve with SIGINT ignored (`pdserve serve &` in a script)
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    if noted:
        interrupted()
    if args.address is None:
        check_local_kv_fits(cfg)
    cluster = start_cluster(cfg)
    if note:
        print(note, flush=True)
    http = f", OpenAI API on http://{cluster.http_address}/v1 (metrics: /metrics)" if cluster.http_address else ""
    if cfg.engine.quantization != "none":
        http += f"; decoder linears quantized to {cfg.engine.quantization}"
    if cfg.engine.lm_head_quantization != "none":
        http += f"; lm_head quantized to {cfg.engine.lm_head_quantization}"
    keys = len(cfg.api_keys)
    http += f"; API keys: {keys} required" if keys else "; API keys: off (anyone who can reach the ports may call)"
    print(
        f"pdserve {args.placement} cluster serving on {cluster.address} (gRPC){http} "
        f"(workers: {', '.join(f'{r}@{a}' for a, r in cluster.workers.items())}); Ctrl-C stops it",
        flush=True,
    )
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop:
            signal.pause()
    finally:
        print("shutting down...", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="start a cluster and serve gRPC and the OpenAI HTTP API until Ctrl-C")
    add_cluster_args(p)
    p.add_argument(
        "--http-port",
        type=port,
        default=DEFAULT_HTTP_PORT,
        help="OpenAI-compatible HTTP API and /metrics, on --host (0 turns it off)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'authorization: Bearer KEY' (gRPC metadata or HTTP header); "
        "comma-separate several; default $PDSERVE_API_KEY, else no key",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--max-requests-per-worker",
        type=non_negative_int,
        default=512,
        help="refuse new requests (RESOURCE_EXHAUSTED / HTTP 429, retry hint 1 s) when every decode "
        "worker holds this many; 0 = no bound",
    )
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="tokens per streamed message to a client, gRPC and HTTP (default 1: every token at once); "
        "the first token and the end are never held back. Larger values cost the router and the client "
        "less CPU per token and make the inter-token latency burstier",
    )
    p.set_defaults(func=cmd_serve)
