"""Link faults between the prefill node and the decode node, on two real Ray nodes
(``pdserve.soak.netns``: two network namespaces joined by a veth pair, prefill on the head,
decode on the worker node, so every KV cache crosses the link).

    sudo python -m pdserve.soak.link_chaos [--cases none,slow,...] [--requests 8] [--serve-log FILE]

One ``pdserve serve`` runs every case in turn. A case shapes the link, sends ``--requests`` greedy
requests at once (random prompts of ``PROMPT_TOKENS`` tokens, whose KV is 3 MiB each in float32
with the embedded model; ``MAX_TOKENS`` tokens each, EOS ignored; a gRPC deadline of
``REQUEST_DEADLINE_S`` each), cuts the link for ``cut_s`` seconds once a KV push is in flight (a
request has its first token and not its second), and waits until every request ended. Then the
link is clean again, and it waits up to ``SETTLE_S`` for every worker to hold no KV block,
sequence or KV wait. The client runs in the router's namespace (Ray puts the router on either
node), so the faults hit the links between the nodes: the KV pushes, and the router's calls to
the worker on the other node. The cases (``CASES``):

- ``none``: a clean link (the control);
- ``slow``: 16 Mbit/s each way, so the eight 3 MiB pushes take about 13 s together;
- ``loss``: 5% of packets dropped each way;
- ``delay``: 50 ms each way (needs ``tc netem``; skipped without it, saying why);
- ``cut-5s``: the slow link, cut for 5 s while KV is in flight: TCP resends once it is back;
- ``cut-15s``: the same for 15 s: more than TCP's resends are sure to ride out (RIDE_OUT_S);
- ``cut-35s``: the same for 35 s: past keepalive's detection and the 30 s deadline of the pushes
  in flight (``prefill_worker/kv_sender.py``), so calls across the link fail, the KV lease is
  lost (``router/kv_lease.py``), and each request migrates or ends with an in-band error.

Each request must end with all its tokens (equal to an undisturbed greedy run), or with a clear
error (a status code and a message) within its case's bound (``FaultCase.bound_s``), never by
running into its own deadline; and no worker may hold a KV block afterwards. Prints a table:
fault | requests | completed | migrated | errored (codes) | max time to end | leaked blocks
("migrated": migrations the router counted during the case, ``pdserve:request_migrations_total``;
a migrated request that then completed also counts as completed).
Exit status 0 when every check held, 1 when one failed, 2 when the nodes cannot be made here.

A cut is not always ridden out even when short. gRPC sets TCP_USER_TIMEOUT (20 s) on its sockets,
and on the kernel measured (6.18) a gRPC connection that once waited out a stall was aborted
(ETIMEDOUT) at the first retransmission of any later stall, even a minute later, as if the 20 s
counted from the earlier stall (the same connection without TCP_USER_TIMEOUT rode it out). The
calls on it fail UNAVAILABLE at once; the cases after the first cut show it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.soak.link_chaos_driver import CASES, REQUEST_DEADLINE_S, REQUESTS_PER_CASE, SETTLE_S, FaultCase
from pdserve.soak.link_chaos_report import problems, table_lines
from pdserve.soak.link_faults import clear_link, set_link
from pdserve.soak.netns import TwoNodes
from pdserve.soak.ray_nodes import DECODE_RESOURCE, PREFILL_RESOURCE

SERVE_START_S = 180.0  # two Ray nodes and two workers on 2 cores
SERVING_LINE = re.compile(r"serving on (\S+) \(gRPC\)(?:, OpenAI API on http://(\S+)/v1)?.*\(workers: (.*)\); Ctrl-C")


class ServeOnTwoNodes:
    """``pdserve serve ARGS`` in the head's namespace of ``nodes``, joined to its Ray head, prefill
    pinned to the head and decode to the worker node; its output collected line by line (``lines``)."""

    def __init__(self, nodes: TwoNodes, args: list[str], env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = nodes.popen(
            nodes.head_ns,
            [
                sys.executable,
                "-m",
                "pdserve.cli.main",
                "serve",
                *args,
                "--address",
                nodes.head_address,
                "--prefill-resource",
                PREFILL_RESOURCE,
                "--decode-resource",
                DECODE_RESOURCE,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def log_tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def wait_for(self, pattern: re.Pattern, timeout_s: float) -> re.Match:
        """The first output line matching ``pattern``. RuntimeError (with the output's tail) when serve
        exits first, TimeoutError past ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := pattern.search(line):
                    return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"no {pattern.pattern!r} from pdserve serve after {timeout_s:.0f}s:\n{self.log_tail()}")

    def wait_serving(self, timeout_s: float) -> tuple[str, str | None, dict[str, str]]:
        """(router gRPC address, HTTP address or None, {role: worker address}) once it serves;
        errors as ``wait_for``."""
        m = self.wait_for(SERVING_LINE, timeout_s)
        return m[1], m[2], dict(w.split("@") for w in m[3].split(", "))

    def stop(self) -> None:
        """Ctrl-C-like stop (SIGTERM), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def run_link_chaos(
    nodes: TwoNodes,
    cases: list[FaultCase],
    n: int = REQUESTS_PER_CASE,
    model: str = "embedded",
    seed: int = 0,
    echo: bool = False,
    serve_log: Path | None = None,
) -> tuple[list[dict], str]:
    """``pdserve serve`` on ``nodes`` (float32), the driver (``link_chaos_driver``) run in the
    router's namespace, serve stopped; the rows and serve's output (also written to ``serve_log``,
    whatever happened). ``echo``: the driver's progress goes to our stderr. RuntimeError when serve
    exits early or the driver fails; TimeoutError when serve does not serve within SERVE_START_S
    seconds."""
    import secrets

    from pdserve.engine.models.loader import resolve_model_dir

    secret = secrets.token_hex(32)
    env = nodes.env(PDSERVE_CLUSTER_SECRET=secret)
    env.pop("PDSERVE_API_KEY", None)
    serve = ServeOnTwoNodes(
        nodes, ["--model", str(resolve_model_dir(model)), "--dtype", "float32", "--port", "0", "--http-port", "0"], env
    )
    try:
        router, http, workers = serve.wait_serving(SERVE_START_S)
        # the client runs beside the router (Ray puts it on either node), so that the faults hit the
        # links between the nodes: the KV push, and the router's calls to the other node's worker
        on_head = router.rsplit(":", 1)[0] == nodes.head_ip
        ns = nodes.head_ns if on_head else nodes.worker_ns
        spec = {
            "nodes": nodes.describe(),
            "router": router,
            "http": http,
            "workers": workers,
            "router_node": "head (prefill)" if on_head else "worker (decode)",
            "cases": [c.name for c in cases],
            "requests": n,
            "model": model,
            "seed": seed,
        }
        # the cases' own waits are bounded: each request by its deadline, each settle by SETTLE_S
        limit_s = len(cases) * (REQUEST_DEADLINE_S + SETTLE_S + 60.0)
        res = nodes.run(
            ns,
            [sys.executable, "-m", "pdserve.soak.link_chaos_driver", json.dumps(spec)],
            timeout_s=limit_s,
            env=env,
            stdout=subprocess.PIPE,
            stderr=None if echo else subprocess.PIPE,
            text=True,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"the link chaos driver failed ({res.returncode}):\n{(res.stderr or '')[-3000:]}\n"
                f"pdserve serve:\n{serve.log_tail()}"
            )
        rows = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        serve.stop()
        clear_link(nodes)
        set_link(nodes, True)
        if serve_log is not None:
            serve_log.write_text("".join(serve.lines))
    return rows, "".join(serve.lines)


def _parse_cases(text: str) -> list[FaultCase]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if bad := [c for c in names if c not in CASES]:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(bad)}: choose from {', '.join(CASES)}")
    return [CASES[c] for c in names]


def main(argv: list[str] | None = None) -> int:
    from pdserve.worker.flags import positive_int

    p = argparse.ArgumentParser(
        prog="python -m pdserve.soak.link_chaos",
        description="Link faults between a prefill and a decode Ray node (root).",
    )
    p.add_argument(
        "--cases", type=_parse_cases, default=list(CASES.values()), help=f"comma-separated: {','.join(CASES)}"
    )
    p.add_argument("--requests", type=positive_int, default=REQUESTS_PER_CASE, help="requests per case, sent at once")
    p.add_argument("--model", default="embedded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-log", default=None, help="write pdserve serve's output to this file")
    args = p.parse_args(argv)
    from pdserve.soak.netns import NetnsUnavailable
    from pdserve.soak.ray_nodes import two_nodes

    try:
        with two_nodes() as nodes:
            print(
                f"two Ray nodes: head (prefill) {nodes.head_ip}, worker (decode) {nodes.worker_ip}; link "
                f"{nodes.veth[0]} <-> {nodes.veth[1]}",
                flush=True,
            )
            rows, _ = run_link_chaos(
                nodes,
                args.cases,
                args.requests,
                args.model,
                args.seed,
                echo=True,
                serve_log=Path(args.serve_log) if args.serve_log else None,
            )
    except NetnsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(table_lines(rows)))
    bad = problems(rows)
    print("\n".join(bad) if bad else "every request ended with its tokens or a clear error in time; no KV block leaked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
