"""Two Ray nodes on one machine, for real: two network namespaces joined by a veth pair, a Ray head
in one and a Ray worker node in the other, with Ray's token authentication on both.

Needs root and ``ip`` (iproute2). Each namespace has its loopback and one end of the veth pair, on
a private /30 (10.213.x.y), and nothing else: what binds inside one namespace is reachable from the
other one only. The head offers the custom Ray resource ``PREFILL_RESOURCE``, the worker node
``DECODE_RESOURCE`` (one unit each), so ``pdserve serve --prefill-resource pdserve_prefill
--decode-resource pdserve_decode`` puts prefill on one node and decode on the other, and every KV
cache crosses the link. Both nodes run with ``RAY_AUTH_MODE=token`` and read one token file
(``RAY_AUTH_TOKEN_PATH``); a driver joins with ``TwoNodes.env()``.

Teardown goes by process id, never by name: every process inside the two namespaces (``ip netns
pids``) gets SIGTERM, then SIGKILL, then the namespaces are deleted, which deletes the veth pair.
(``ray stop`` is not used: it stops every Ray process on the machine.) Every wait is bounded.

Ray's node health check is widened (``RAY_HEALTH_CHECK_FAILURES`` missed checks, 3 s apart) so
that Ray keeps the worker node through a link cut of up to about a minute
(``pdserve.soak.link_faults``): such faults test pdserve's own timeouts, not Ray's handling of
a lost node.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379
PREFILL_RESOURCE, DECODE_RESOURCE = "pdserve_prefill", "pdserve_decode"
IP_TIMEOUT_S = 10.0  # one `ip` command
RAY_START_TIMEOUT_S = 90.0  # one `ray start`
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL
RAY_HEALTH_CHECK_FAILURES = 20  # Ray's default is 5 (a cut of ~15 s would make Ray drop the worker node)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


@dataclass
class TwoNodes:
    """The two namespaces. ``head_ns`` holds the Ray head at ``head_ip``, ``worker_ns`` the Ray
    worker node at ``worker_ip``; ``workdir`` holds the token file, Ray's temp dirs and logs."""

    head_ns: str
    worker_ns: str
    head_ip: str
    worker_ip: str
    veth: tuple[str, str]
    workdir: Path
    _made: list[str] = field(default_factory=list, repr=False)  # namespaces created, for teardown

    @property
    def head_address(self) -> str:
        """The Ray head's "host:port", for ``--address``."""
        return f"{self.head_ip}:{RAY_PORT}"

    @property
    def token_path(self) -> Path:
        return self.workdir / "ray_auth_token"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment plus Ray's token auth (and ``extra``), without RAY_ADDRESS."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path), **extra)
        return env

    def argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, argv: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``ns`` with ``env()`` until it exits; TimeoutExpired after ``timeout_s``
        (the process is killed then)."""
        kw.setdefault("env", self.env())
        return subprocess.run(self.argv(ns, argv), timeout=timeout_s, **kw)

    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``ns`` with ``env()``; the caller waits for it (teardown kills it anyway)."""
        kw.setdefault("env", self.env())
        return subprocess.Popen(self.argv(ns, argv), **kw)

    def pids(self, ns: str) -> list[int]:
        """Every live process inside namespace ``ns``."""
        out = _ip(["netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split()]

    def pids_titled(self, ns: str, prefix: str) -> list[int]:
        """Processes in ``ns`` whose command line starts with ``prefix`` (Ray titles an actor's
        process "ray::ClassName")."""
        found = []
        for pid in self.pids(ns):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(prefix):
                found.append(pid)
        return found

    def describe(self) -> dict:
        """What another process needs to drive these namespaces (``TwoNodes.attach``)."""
        return {
            "head_ns": self.head_ns,
            "worker_ns": self.worker_ns,
            "head_ip": self.head_ip,
            "worker_ip": self.worker_ip,
            "veth": list(self.veth),
            "workdir": str(self.workdir),
        }

    @classmethod
    def attach(cls, description: dict) -> TwoNodes:
        """The namespaces ``describe`` describes, made by another process, which also tears them down
        (this object's ``close`` kills nothing and deletes nothing but ``workdir``: do not call it)."""
        d = dict(description)
        return cls(d["head_ns"], d["worker_ns"], d["head_ip"], d["worker_ip"], tuple(d["veth"]), Path(d["workdir"]))

    def close(self) -> None:
        """Kill every process in both namespaces, delete them (and the veth pair), remove ``workdir``.
        Safe to call twice and after a partial setup; one failing step does not stop the others."""
        steps = [lambda ns=ns: _kill_all(self, ns) for ns in reversed(self._made)]
        steps += [lambda ns=ns: _ip(["netns", "del", ns], check=False) for ns in reversed(self._made)]
        # a veth end is only left in our own namespace when setup failed before moving it
        steps += [
            lambda name=name: Path(f"/sys/class/net/{name}").exists() and _ip(["link", "del", name], check=False)
            for name in self.veth
        ]
        for step in steps:
            try:
                step()
            except (OSError, subprocess.SubprocessError) as exc:
                print(f"two-node teardown: {exc}", file=sys.stderr)
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _ip(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and res.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res


def _kill_all(nodes: TwoNodes, ns: str) -> None:
    """SIGTERM every process in ``ns``, SIGKILL what is left after KILL_GRACE_S, wait as long again."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        pids = nodes.pids(ns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = nodes.pids(ns)
        if not pids:
            return


def make_namespaces() -> TwoNodes:
    """Two fresh namespaces with unique names, joined by a veth pair on a random private /30, loopback
    and veth up in both. NetnsUnavailable (after undoing what was made) when that is impossible here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("no `ip` command (iproute2)")
    tag = secrets.token_hex(3)
    third, fourth = random.randrange(256), random.randrange(64) * 4  # a /30 inside 10.213.0.0/16
    nodes = TwoNodes(
        head_ns=f"pdserve-h-{tag}",
        worker_ns=f"pdserve-w-{tag}",
        head_ip=f"10.213.{third}.{fourth + 1}",
        worker_ip=f"10.213.{third}.{fourth + 2}",
        veth=(f"pdsv{tag}h", f"pdsv{tag}w"),
        workdir=Path(tempfile.mkdtemp(prefix="pdserve-2nodes-")),
    )
    try:
        for ns in (nodes.head_ns, nodes.worker_ns):
            _ip(["netns", "add", ns])
            nodes._made.append(ns)
        _ip(["link", "add", nodes.veth[0], "type", "veth", "peer", "name", nodes.veth[1]])
        for ns, dev, ip in (
            (nodes.head_ns, nodes.veth[0], nodes.head_ip),
            (nodes.worker_ns, nodes.veth[1], nodes.worker_ip),
        ):
            _ip(["link", "set", dev, "netns", ns])
            _ip(["-n", ns, "addr", "add", f"{ip}/30", "dev", dev])
            _ip(["-n", ns, "link", "set", "lo", "up"])
            _ip(["-n", ns, "link", "set", dev, "up"])
    except BaseException:
        nodes.close()
        raise
    return nodes


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
