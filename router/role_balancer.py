"""When a switchable worker should change role: the router's P:D policy for ``--placement auto``.

Every ``window_s`` the router reads each switchable worker's busy time from its stats (nanoseconds
spent in steps with a prompt chunk and in decode-only steps, ``WorkerStats.prefill_busy_ns`` and
``decode_busy_ns``) and turns the growth since the last window into shares of the window, and it
takes the TTFT p90 and TPOT p90 of the requests completed in the last few seconds (``LATENCY_WINDOW_S``).

**SLO moves first** (NVIDIA Dynamo's planner also acts on measured latency against targets): when
the TPOT p90 is over its target (``slo_tpot_s``) while the decode workers spend at least
``min_local_share`` of their time in steps with a prompt chunk, a decode worker moves to prefill
(reason ``slo``): prompt chunks stretch the decode steps they share, which a prefill worker of its
own cures (DistServe's argument for splitting the phases). It needs a second decode worker, both
sides must stay under ``high`` after it, and the TTFT p90 must be within its target
(``slo_ttft_s``): after a split the prompts queue on fewer workers, so a TTFT already over target
would only grow (more prefill capacity is what it calls for: a hot prefill side gets it from the
utilisation rule, one with room from the SLO merge below). For ``hold_s`` after such a move no
utilisation move may empty the prefill role again.

**SLO merges** go the other way: when the TPOT p90 or the TTFT p90 is over its target beside a
prefill side with room (each prefill worker busy under ``PREFILL_FULL``), a prefill worker moves to
decode (reason ``slo``) if the window's work, prompts included, fits the workers after it. With
TPOT over, the decode side is short of workers, and a decode step's cost grows more slowly than its
batch (the weights are read once a step), so two workers decoding half the batch each beside their
own prompts can beat one decoding all of it (a 2-core AMX Xeon, W2 at 8 req/s: colocated's TPOT p50
31-44 ms against split's 36-53 ms, docs/measurements.md). With only TTFT over, prompts queue behind
each other on the prefill workers and then wait for the hand-off and a first decode step elsewhere;
spread over more workers and finished where they were prefilled, they wait less (a 2-core AVX-512
EPYC, W2 at 2-4 req/s, about 180 ms a 256-token prompt on one core: split's TTFT p90 648-874 ms
with its prefill worker 36-72 % busy, colocated's 297-431 ms; a 2-core Zen 5 EPYC, W2 at 6-8 req/s:
split's 518-692 ms, colocated's 217-312 ms with both workers so busy that the utilisation view,
mixing costed, calls the merged pair hot).

An SLO move in one direction waits ``hold_s`` after one in the other, and a move that undoes the
last SLO move (an SLO move because its target was still missed after it, or a utilisation move)
bars the move it undid for ``learn_s``, twice as long each further time: the balancer tries each
direction, keeps what met the target, and on a load that neither serves within it (a model too slow
for the TPOT target at any batch) switches ever more rarely.

**Utilisation moves** balance the busier side, and only when it is hot (at least ``high``): with
``P`` prefill and ``D`` decode workers its utilisation is ``max(prefill work / P, decode side / D)``.
The balancer predicts it after moving one worker either way (never the last decode worker) and
proposes the move that lowers it by more than ``margin``. Prompt work that moves onto decode workers
(the last prefill worker leaving: every decode worker then prefills its own requests, which is
colocated placement) costs ``mix_cost`` times its time on a prefill worker (prompt work leaving
decode workers for a new prefill worker is counted at the time it took there): a decode row in a
step beside a prompt chunk costs 1.3-1.6 times its decode-step time (``pdserve profile``'s mixed
fit, docs/measurements.md) and the prompt's tokens wait for the rows beside them.
For ``hold_s`` after an SLO move no utilisation move undoes it, nor later while the window's
latency p90s meet their targets: the targets are what the user asked for, the utilisation view
only a forecast.

Hysteresis, as NVIDIA Dynamo's SLA planner learnt it (oscillation between two replica counts,
scaling on no traffic): a move is proposed only after ``patience`` consecutive windows agree on it;
none within ``cooldown_s`` of the last switch; none while a worker is draining; and none in a
window with no work (the latency p90s cover the last seconds, so just after a burst they still read
over target while every worker idles).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}
PREFILL_FULL = 0.9  # a prefill side this busy is short of workers itself: no SLO merge takes one


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
    reason: str = "utilisation"  # or "slo"


def bottleneck(loads: list[WorkerLoad], num_prefill: int, num_decode: int, mix_cost: float = 1.0) -> float:
    """Utilisation of the busier side if the window's work ran on ``num_prefill`` prefill and
    ``num_decode`` decode workers: prompt work goes to the decode side when ``num_prefill`` is 0
    (times ``mix_cost``), and prompt work done on decode workers moves to the prefill side when
    there was no prefill worker."""
    remote = sum(w.busy for w in loads if w.role == "prefill")
    decode_side = sum(w.busy for w in loads if w.role == "decode")
    if num_prefill == 0:
        return (remote * mix_cost + decode_side) / num_decode
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
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    high: float = 0.75
    mix_cost: float = 1.5
    min_local_share: float = 0.1
    hold_s: float = 60.0
    learn_s: float = 600.0
    _streak: tuple[str, str] | None = field(default=None, repr=False)
    _count: int = field(default=0, repr=False)
    _last_switch_s: float = field(default=float("-inf"), repr=False)
    _slo_at: dict = field(default_factory=dict, repr=False)  # SLO move's to_role -> when it was last made (s)
    _last_slo_role: str | None = field(default=None, repr=False)  # the last SLO move's to_role, until undone
    _barred: dict = field(default_factory=dict, repr=False)  # SLO move's to_role -> barred until (s)
    _undone: dict = field(default_factory=dict, repr=False)  # SLO move's to_role -> times undone

    def __post_init__(self) -> None:
        if not (0.0 <= self.margin < 1.0 and self.patience >= 1 and self.cooldown_s >= 0 and self.mix_cost >= 1.0):
            raise ValueError(
                f"role balancer: margin within [0, 1), patience >= 1, cooldown_s >= 0 and mix_cost >= 1, "
                f"got {self.margin}, {self.patience}, {self.cooldown_s}, {self.mix_cost}"
            )

    def best_move(
        self,
        loads: list[WorkerLoad],
        ttft_p90_s: float | None = None,
        tpot_p90_s: float | None = None,
        now_s: float = 0.0,
    ) -> Move | None:
        """The move for one window's ``loads`` and latencies (the p90s of the requests completed in
        it, seconds): an ``slo`` move, else the utilisation move that lowers a hot bottleneck most,
        by more than ``margin``; None if none qualifies."""
        p = sum(1 for w in loads if w.role == "prefill")
        d = sum(1 for w in loads if w.role == "decode")
        if d == 0 or not any(w.busy > 0 for w in loads):  # no work this window: nothing to balance
            return None
        now = bottleneck(loads, p, d)
        slow = self.slo_tpot_s is not None and tpot_p90_s is not None and tpot_p90_s > self.slo_tpot_s
        ttft_over = self.slo_ttft_s is not None and ttft_p90_s is not None and ttft_p90_s > self.slo_ttft_s
        to_prefill = to_decode = None
        if d >= 2:  # a decode worker to prefill: the one whose streams end soonest (least busy)
            w = min((w for w in loads if w.role == "decode"), key=lambda w: w.busy)
            to_prefill = Move(w.address, "decode", "prefill", now, bottleneck(loads, p + 1, d - 1, self.mix_cost))
            local = sum(w.prefill_busy for w in loads if w.role == "decode") / d
            if (
                slow
                and not ttft_over
                and local >= self.min_local_share
                and to_prefill.predicted < self.high
                and self._slo_allowed("prefill", now_s)
            ):
                return Move(to_prefill.address, "decode", "prefill", now, to_prefill.predicted, "slo")
        if p >= 1:  # a prefill worker to decode: the least busy one
            w = min((w for w in loads if w.role == "prefill"), key=lambda w: w.busy)
            to_decode = Move(w.address, "prefill", "decode", now, bottleneck(loads, p - 1, d + 1, self.mix_cost))
            prefill_full = sum(w.busy for w in loads if w.role == "prefill") / p >= PREFILL_FULL
            fits = bottleneck(loads, p - 1, d + 1) < 1.0  # the window's work, mixing not costed
            if (slow or ttft_over) and not prefill_full and fits and self._slo_allowed("decode", now_s):
                return Move(to_decode.address, "prefill", "decode", now, to_decode.predicted, "slo")
        if now < self.high:
            return None
        # the role the last SLO move made, kept while the latencies meet their targets
        kept = self._last_slo_role if self._meeting(ttft_p90_s, tpot_p90_s) else None
        options = []
        if to_prefill and now_s - self._slo_time("decode") >= self.hold_s and kept != "decode":
            options.append(to_prefill)
        if to_decode and not (p == 1 and now_s - self._slo_time("prefill") < self.hold_s) and kept != "prefill":
            options.append(to_decode)
        best = min(options, key=lambda m: m.predicted, default=None)
        return best if best is not None and best.predicted < now - self.margin else None

    def observe(
        self,
        now_s: float,
        loads: list[WorkerLoad],
        draining: bool = False,
        ttft_p90_s: float | None = None,
        tpot_p90_s: float | None = None,
    ) -> Move | None:
        """One window's loads and latency p90s (seconds) at ``now_s``; the move to make now, or
        None. Call ``switched`` once a proposed move is done."""
        cooling = draining or now_s - self._last_switch_s < self.cooldown_s
        move = None if cooling else self.best_move(loads, ttft_p90_s, tpot_p90_s, now_s)
        key = (move.from_role, move.to_role) if move else None
        self._count = self._count + 1 if key is not None and key == self._streak else int(key is not None)
        self._streak = key
        if move is None or self._count < self.patience:
            return None
        self._streak, self._count = None, 0
        if self._last_slo_role == move.from_role:
            # it undoes the last SLO move, whatever its own reason: bar that one, twice as long each time
            self._undone[move.from_role] = self._undone.get(move.from_role, 0) + 1
            self._barred[move.from_role] = now_s + self.learn_s * 2 ** (self._undone[move.from_role] - 1)
            self._last_slo_role = None
        if move.reason == "slo":
            self._slo_at[move.to_role] = now_s
            self._last_slo_role = move.to_role
        return move

    def _meeting(self, ttft_p90_s: float | None, tpot_p90_s: float | None) -> bool:
        """Whether the window's latency p90s (seconds) meet the targets set: at least one measured
        against its target, and none over."""
        pairs = ((ttft_p90_s, self.slo_ttft_s), (tpot_p90_s, self.slo_tpot_s))
        measured = [(v, t) for v, t in pairs if v is not None and t is not None]
        return bool(measured) and all(v <= t for v, t in measured)

    def _slo_allowed(self, to_role: str, now_s: float) -> bool:
        """An SLO move to ``to_role``: not barred, and ``hold_s`` after an SLO move the other way."""
        return (
            now_s >= self._barred.get(to_role, float("-inf"))
            and now_s - self._slo_time(_OTHER_ROLE[to_role]) >= self.hold_s
        )

    def _slo_time(self, to_role: str) -> float:
        """When the last SLO move to ``to_role`` was made (-inf: never)."""
        return self._slo_at.get(to_role, float("-inf"))

    def switched(self, now_s: float) -> None:
        """A switch ended at ``now_s`` (done or given up): the cooldown starts."""
        self._last_switch_s = now_s
