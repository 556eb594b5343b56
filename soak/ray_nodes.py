"""The two Ray nodes on the network namespaces of :mod:`pdserve.soak.netns`, and a run across them.

:func:`start_ray_nodes` starts a Ray head in the head's namespace and a Ray worker node in the
other, each with its own temp dir and Ray's token authentication (``RAY_AUTH_MODE=token``, one token
file, ``RAY_AUTH_TOKEN_PATH``; a driver joins with ``TwoNodes.env()``). The head offers the custom
Ray resource ``PREFILL_RESOURCE``, the worker node ``DECODE_RESOURCE`` (one unit each), so ``pdserve
serve --prefill-resource pdserve_prefill --decode-resource pdserve_decode`` puts prefill on one node
and decode on the other, and every KV cache crosses the link. :func:`two_nodes` gives namespaces
and nodes, torn down on exit; :func:`run_on_two_nodes` runs a ``pdserve`` command on them.

Ray's node health check is widened (``RAY_HEALTH_CHECK_FAILURES`` missed checks, 3 s apart) so
that Ray keeps the worker node through a link cut of up to about a minute
(``pdserve.soak.link_faults``): such faults test pdserve's own timeouts, not Ray's handling of
a lost node. ``ray stop`` is never used (it stops every Ray process on the machine): the nodes go
when the namespaces' processes are killed. Every wait is bounded.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.soak.netns import RAY_PORT, TwoNodes, make_namespaces

PREFILL_RESOURCE, DECODE_RESOURCE = "pdserve_prefill", "pdserve_decode"
RAY_START_TIMEOUT_S = 90.0  # one `ray start`
RAY_HEALTH_CHECK_FAILURES = 20  # Ray's default is 5 (a cut of ~15 s would make Ray drop the worker node)


def _ray_start(nodes: TwoNodes, ns: str, args: list[str], log_name: str, env: dict[str, str] | None = None) -> None:
    """``ray start ARGS`` inside ``ns`` (with ``env``, default ``nodes.env()``); RuntimeError with its
    log's tail when it fails."""
    log_path = nodes.workdir / log_name
    with open(log_path, "w") as log:
        try:
            res = nodes.run(
                ns,
                [sys.executable, "-m", "ray.scripts.scripts", "start", *args],
                timeout_s=RAY_START_TIMEOUT_S,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env or nodes.env(),
            )
            ok = res.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    if not ok:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"ray start in namespace {ns} failed:\n{tail}")


def start_ray_nodes(nodes: TwoNodes, cpus_per_node: int = 1, object_store_bytes: int = 200 * 2**20) -> None:
    """A Ray head in ``head_ns`` (offering PREFILL_RESOURCE) and a worker node in ``worker_ns``
    (offering DECODE_RESOURCE), each with ``cpus_per_node`` CPUs, no GPU, token auth, and its own
    temp dir under ``workdir`` (so neither touches another Ray instance's /tmp/ray)."""
    nodes.token_path.write_text(secrets.token_hex(32))
    nodes.token_path.chmod(0o600)
    common = [
        "--num-cpus",
        str(cpus_per_node),
        "--num-gpus",
        "0",
        "--disable-usage-stats",
        "--object-store-memory",
        str(object_store_bytes),
    ]
    # the GCS (on the head) drops a node after this many missed health checks: room for a link cut
    head_env = nodes.env(RAY_health_check_failure_threshold=str(RAY_HEALTH_CHECK_FAILURES))
    _ray_start(
        nodes,
        nodes.head_ns,
        [
            "--head",
            "--node-ip-address",
            nodes.head_ip,
            "--port",
            str(RAY_PORT),
            "--include-dashboard",
            "false",
            "--temp-dir",
            str(nodes.workdir / "ray-head"),
            "--resources",
            json.dumps({PREFILL_RESOURCE: 1}),
            *common,
        ],
        "ray-head.log",
        env=head_env,
    )
    _ray_start(
        nodes,
        nodes.worker_ns,
        [
            "--address",
            nodes.head_address,
            "--node-ip-address",
            nodes.worker_ip,
            "--temp-dir",
            str(nodes.workdir / "ray-worker"),
            "--resources",
            json.dumps({DECODE_RESOURCE: 1}),
            *common,
        ],
        "ray-worker.log",
    )


@contextmanager
def two_nodes(cpus_per_node: int = 1) -> Iterator[TwoNodes]:
    """Namespaces, veth pair and both Ray nodes; everything is torn down on exit, also on failure.
    Raises NetnsUnavailable when namespaces cannot be made here, RuntimeError when Ray does not start."""
    nodes = make_namespaces()
    try:
        start_ray_nodes(nodes, cpus_per_node)
        yield nodes
    finally:
        nodes.close()


def run_on_two_nodes(pdserve_args: list[str], timeout_s: float) -> int:
    """``pdserve PDSERVE_ARGS --address HEAD --prefill-resource ... --decode-resource ...`` inside the
    head's namespace of two fresh Ray nodes, its output on ours; its exit status (124 past
    ``timeout_s`` seconds). Everything is torn down after."""
    with two_nodes() as nodes:
        print(
            f"two Ray nodes: head (prefill) {nodes.head_ip} in namespace {nodes.head_ns}, worker (decode) "
            f"{nodes.worker_ip} in {nodes.worker_ns}",
            flush=True,
        )
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli.main",
            *pdserve_args,
            "--address",
            nodes.head_address,
            "--prefill-resource",
            PREFILL_RESOURCE,
            "--decode-resource",
            DECODE_RESOURCE,
        ]
        try:
            return nodes.run(nodes.head_ns, argv, timeout_s=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"error: still running after {timeout_s:.0f}s; stopped", file=sys.stderr)
            return 124
