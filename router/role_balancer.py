"""When a switchable worker should change role: the router's P:D policy for ``--placement auto``.

Every ``window_s`` the router reads each switchable worker's busy time from its stats (nanoseconds
spent in steps with a prompt chunk and in decode-only steps, ``WorkerStats.prefill_busy_ns`` and
``decode_busy_ns``) and turns the growth since the last window into shares of the window:

- ``remote_prefill``: busy share of the prefill workers (their work moves with the prefill role);
- ``decode_side``: busy share of the decode workers, their local prefills included.

With ``P`` prefill and ``D`` decode workers the bottleneck is ``max(remote_prefill / P, decode_side / D)``
(the utilisation of the busier side). The balancer predicts it after moving one worker either way
(one prefill worker to decode; or one decode worker to prefill, keeping at least one decode worker)
and proposes the move when it lowers the bottleneck by more than ``margin``. Moving the last
prefill worker is allowed: its prompts are then prefilled on the decode workers, which is
colocated placement, and a later move brings the prefill role back when the decode side's prompt
work (``prefill_busy`` on decode workers) would be better served by a worker of its own.

Utilisation alone always prefers colocated placement (the same work spread over every worker), but
prompt chunks stretch the decode steps they share (the interference DistServe splits phases for).
So with a TPOT target (``slo_tpot_s``), a window whose completed requests' TPOT p90 (at the router)
is over it while the decode workers spend at least ``min_local_share`` of their time in steps with a
prompt chunk proposes moving a decode worker to prefill (reason ``tpot``), if both sides could keep
up after it (predicted bottleneck under ``1 - margin``); and for ``hold_s`` after such a move no
utilisation move may empty the prefill role again.

Hysteresis, as NVIDIA Dynamo's SLA planner learnt it (oscillation between two replica counts,
scaling on no traffic): a move is proposed only after ``patience`` consecutive windows agree on it;
none within ``cooldown_s`` of the last switch; none while a worker is draining; and with no traffic
the bottleneck is near 0, so no move can gain ``margin``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerLoad:
    """One switchable worker in one window: its role and the shares (0..1) of the window it spent
    in steps with a prompt chunk (``prefill_busy``) and in decode-only steps (``decode_busy``)."""

    address: str
    role: str
    prefill_busy: float
    decode_busy: float

    @property
    def busy(self) -> float:
        return self.prefill_busy + self.decode_busy


@dataclass(frozen=True)
class Move:
    """Switch ``address`` from ``from_role`` to ``to_role``; the bottleneck utilisation now and predicted."""

    address: str
    from_role: str
    to_role: str
    bottleneck: float
    predicted: float
    reason: str = "utilisation"  # or "tpot"


def bottleneck(loads: list[WorkerLoad], num_prefill: int, num_decode: int) -> float:
    """Utilisation of the busier side if the same work ran on ``num_prefill`` prefill and
    ``num_decode`` decode workers (prompt work goes to the decode side when ``num_prefill`` is 0)."""
    remote = sum(w.busy for w in loads if w.role == "prefill")
    decode_side = sum(w.busy for w in loads if w.role == "decode")
    if num_prefill == 0:
        return (remote + decode_side) / num_decode
    if not any(w.role == "prefill" for w in loads):  # prompt work now on decode workers moves over
        local = sum(w.prefill_busy for w in loads if w.role == "decode")
        return max(local / num_prefill, (decode_side - local) / num_decode)
    return max(remote / num_prefill, decode_side / num_decode)


@dataclass
class RoleBalancer:
    """Proposes at most one ``Move`` per window (module docstring). Times are seconds."""

    margin: float = 0.15
    patience: int = 3
    cooldown_s: float = 10.0
    slo_tpot_s: float | None = None
    min_local_share: float = 0.1
    hold_s: float = 60.0
    _streak: tuple[str, str] | None = field(default=None, repr=False)
    _count: int = field(default=0, repr=False)
    _last_switch_s: float = field(default=float("-inf"), repr=False)
    _tpot_split_s: float = field(default=float("-inf"), repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0 or self.patience < 1 or self.cooldown_s < 0:
            raise ValueError(
                f"role balancer: margin within [0, 1), patience >= 1 and cooldown_s >= 0, "
                f"got {self.margin}, {self.patience}, {self.cooldown_s}"
            )

    def best_move(self, loads: list[WorkerLoad], tpot_p90_s: float | None = None, now_s: float = 0.0) -> Move | None:
        """The move for one window's ``loads`` (and the TPOT p90 of the requests completed in it, seconds): a ``tpot``
        move, else the utilisation move that lowers the bottleneck most, by more than ``margin``;
        None if none qualifies."""
        p = sum(1 for w in loads if w.role == "prefill")
        d = sum(1 for w in loads if w.role == "decode")
        if d == 0:
            return None
        now = bottleneck(loads, p, d)
        to_prefill = None
        if d >= 2:  # a decode worker to prefill: the one whose streams end soonest (least busy)
            w = min((w for w in loads if w.role == "decode"), key=lambda w: w.busy)
            to_prefill = Move(w.address, "decode", "prefill", now, bottleneck(loads, p + 1, d - 1))
            local = sum(w.prefill_busy for w in loads if w.role == "decode") / d
            slow = self.slo_tpot_s is not None and tpot_p90_s is not None and tpot_p90_s > self.slo_tpot_s
            if slow and local >= self.min_local_share and to_prefill.predicted < 1.0 - self.margin:
                return Move(to_prefill.address, "decode", "prefill", now, to_prefill.predicted, "tpot")
        options = [to_prefill] if to_prefill else []
        if p >= 1 and not (p == 1 and now_s - self._tpot_split_s < self.hold_s):  # a prefill worker to decode
            w = min((w for w in loads if w.role == "prefill"), key=lambda w: w.busy)
            options.append(Move(w.address, "prefill", "decode", now, bottleneck(loads, p - 1, d + 1)))
        best = min(options, key=lambda m: m.predicted, default=None)
        return best if best is not None and best.predicted < now - self.margin else None

    def observe(
        self, now_s: float, loads: list[WorkerLoad], draining: bool = False, tpot_p90_s: float | None = None
    ) -> Move | None:
        """One window's loads at ``now_s`` (and TPOT p90, seconds); the move to make now, or None.
        Call ``switched`` once a proposed move is done."""
        cooling = draining or now_s - self._last_switch_s < self.cooldown_s
        move = None if cooling else self.best_move(loads, tpot_p90_s, now_s)
        key = (move.from_role, move.to_role) if move else None
        self._count = self._count + 1 if key is not None and key == self._streak else int(key is not None)
        self._streak = key
        if move is None or self._count < self.patience:
            return None
        self._streak, self._count = None, 0
        if move.reason == "tpot":
            self._tpot_split_s = now_s
        return move

    def switched(self, now_s: float) -> None:
        """A switch ended at ``now_s`` (done or given up): the cooldown starts."""
        self._last_switch_s = now_s
