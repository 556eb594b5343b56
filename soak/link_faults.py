"""Faults on the link between the two Ray nodes of ``pdserve.soak.netns`` (root, ``ip`` and ``tc``).

- **Shapes** (``shape_link``: a rate, packet loss, a delay, on each direction): ``tc netem`` on
  both veth ends where the kernel has it. Where it does not ("Specified qdisc kind is unknown"),
  rate and loss are made from what kernels usually have anyway: an HTB root qdisc whose default
  class is rate-limited, plus a classic-BPF filter (its ancillary load of a random number) that
  sends a random share of packets to a class whose queue holds nothing, so they are dropped. A
  delay has no such substitute: LinkFaultUnavailable says what is missing.
- **A cut** (``set_link(nodes, False)``, then ``True``): ``ip link set DEV down`` on the worker
  node's end; the head's end loses its carrier. Packets are dropped and no connection is reset:
  TCP resends once the link is up again (unless a socket's TCP_USER_TIMEOUT passed meanwhile).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from pdserve.soak.netns import TwoNodes

CMD_TIMEOUT_S = 10.0  # one `tc` or `ip` command
HTB_QUANTUM = 60000  # bytes a class sends per round (explicit: the r2q default warns at both ends of the range)
LINE_RATE = "10gbit"  # an unshaped HTB class
BPF_RANDOM = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: classic BPF's ancillary load of a random u32


class LinkFaultUnavailable(RuntimeError):
    """This machine cannot make the asked link fault (no ``tc``, or the kernel lacks the qdisc or
    classifier it needs, or ``ip`` failed); the message names what is missing."""


@dataclass(frozen=True)
class LinkShape:
    """A link fault applied to each direction of the veth pair: ``rate_mbit`` megabits per second
    (None: line rate), each packet lost with probability ``loss_pct`` percent, ``delay_ms``
    milliseconds added to each packet (netem only). ValueError for a value out of range."""

    rate_mbit: float | None = None
    loss_pct: float = 0.0
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {self.rate_mbit}")
        if not 0.0 <= self.loss_pct <= 100.0:
            raise ValueError(f"loss_pct must be in [0, 100], got {self.loss_pct}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    def __str__(self) -> str:
        parts = (
            ([f"{self.rate_mbit:g} Mbit/s"] if self.rate_mbit else [])
            + ([f"loss {self.loss_pct:g}%"] if self.loss_pct else [])
            + ([f"delay {self.delay_ms:g} ms"] if self.delay_ms else [])
        )
        return ", ".join(parts) or "clean"


def loss_bytecode(loss_pct: float) -> str:
    """A classic BPF program, in ``tc ... bpf bytecode`` form, that matches a packet (returns -1: the
    filter's class) with probability ``loss_pct`` percent and else returns 0 (no match)."""
    threshold = min(int(loss_pct / 100.0 * 2**32), 2**32 - 1)
    prog = [
        (0x20, 0, 0, BPF_RANDOM),  # ld [random]
        (0x35, 1, 0, threshold),  # jge #threshold: skip the match
        (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: matched
        (0x06, 0, 0, 0),
    ]  # ret #0: not matched
    return f"{len(prog)}," + ",".join(" ".join(map(str, ins)) for ins in prog)


def _ends(nodes: TwoNodes) -> tuple[tuple[str, str], tuple[str, str]]:
    """(namespace, device) of the head's end and of the worker node's end."""
    return (nodes.head_ns, nodes.veth[0]), (nodes.worker_ns, nodes.veth[1])


def tc(ns: str, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """``tc ARGS`` inside namespace ``ns``; LinkFaultUnavailable with tc's message when it fails and
    ``check``."""
    if shutil.which("tc") is None:
        raise LinkFaultUnavailable("no `tc` command (iproute2)")
    res = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if check and res.returncode != 0:
        raise LinkFaultUnavailable(f"tc {' '.join(args)}: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res


def netem_missing(nodes: TwoNodes) -> str | None:
    """None when ``tc qdisc ... netem`` works on the veth pair, else why not (tc's message). The probe
    adds and removes a netem qdisc on the head's end: call it while the link is clean."""
    ns, dev = _ends(nodes)[0]
    try:
        tc(ns, ["qdisc", "replace", "dev", dev, "root", "netem", "delay", "1ms"])
    except LinkFaultUnavailable as exc:
        return str(exc)
    tc(ns, ["qdisc", "del", "dev", dev, "root"], check=False)
    return None


def shape_link(nodes: TwoNodes, shape: LinkShape) -> str:
    """Apply ``shape`` to both directions (replacing any shape before); returns how: "netem", or
    "htb+bpf" where the kernel has no netem. LinkFaultUnavailable for a delay without netem, or
    when the kernel lacks HTB or the BPF classifier (the link is left clean then)."""
    clear_link(nodes)
    missing = netem_missing(nodes)
    if missing and shape.delay_ms:
        raise LinkFaultUnavailable(
            f"a delay needs tc netem, which this kernel lacks ({missing}); no other qdisc here holds packets back"
        )
    try:
        for ns, dev in _ends(nodes):
            if not missing:
                args = ["qdisc", "replace", "dev", dev, "root", "netem", "limit", "10000"]
                args += ["delay", f"{shape.delay_ms:g}ms"] if shape.delay_ms else []
                args += ["loss", f"{shape.loss_pct:g}%"] if shape.loss_pct else []
                args += ["rate", f"{shape.rate_mbit:g}mbit"] if shape.rate_mbit else []
                tc(ns, args)
                continue
            tc(ns, ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
            rate = f"{shape.rate_mbit:g}mbit" if shape.rate_mbit else LINE_RATE
            tc(
                ns,
                f"class add dev {dev} parent 1: classid 1:1 htb rate {rate} ceil {rate} quantum {HTB_QUANTUM}".split(),
            )
            if shape.loss_pct:  # the lost share goes to class 1:2, whose queue holds no packet
                tc(ns, f"class add dev {dev} parent 1: classid 1:2 htb rate {LINE_RATE} quantum {HTB_QUANTUM}".split())
                tc(ns, ["qdisc", "add", "dev", dev, "parent", "1:2", "handle", "2:", "pfifo", "limit", "0"])
                bytecode = loss_bytecode(shape.loss_pct)  # holds spaces: one argument
                tc(
                    ns,
                    [
                        *f"filter add dev {dev} parent 1: protocol all prio 1 bpf bytecode".split(),
                        bytecode,
                        "flowid",
                        "1:2",
                    ],
                )
    except BaseException:
        clear_link(nodes)
        raise
    return "htb+bpf" if missing else "netem"


def clear_link(nodes: TwoNodes) -> None:
    """Remove any shape from both ends (each veth end's default qdisc again)."""
    for ns, dev in _ends(nodes):
        tc(ns, ["qdisc", "del", "dev", dev, "root"], check=False)  # fails when there is none


def set_link(nodes: TwoNodes, up: bool) -> None:
    """Bring the worker node's veth end down (a cut: the head's end loses its carrier) or up again.
    LinkFaultUnavailable when ``ip`` fails."""
    ns, dev = _ends(nodes)[1]
    res = subprocess.run(
        ["ip", "-n", ns, "link", "set", dev, "up" if up else "down"],
        capture_output=True,
        text=True,
        timeout=CMD_TIMEOUT_S,
    )
    if res.returncode != 0:
        raise LinkFaultUnavailable(f"ip -n {ns} link set {dev}: {res.stderr.strip() or f'exit {res.returncode}'}")
