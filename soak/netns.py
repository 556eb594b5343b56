"""Two network namespaces on one machine, joined by a veth pair, for two real Ray nodes
(:mod:`pdserve.soak.ray_nodes` starts them: a Ray head in one namespace, a Ray worker node in the
other).

Needs root and ``ip`` (iproute2). Each namespace has its loopback and one end of the veth pair, on
a private /30 (10.213.x.y), and nothing else: what binds inside one namespace is reachable from the
other one only. :class:`TwoNodes` runs commands inside either namespace with Ray's token
authentication in their environment, finds their processes, and tears everything down.

Teardown goes by process id, never by name: every process inside the two namespaces (``ip netns
pids``) gets SIGTERM, then SIGKILL, then the namespaces are deleted, which deletes the veth pair.
(``ray stop`` is not used: it stops every Ray process on the machine.) Every wait is bounded.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379
IP_TIMEOUT_S = 10.0  # one `ip` command
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL


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
