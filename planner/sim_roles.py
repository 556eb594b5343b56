"""Role switching in the simulator (``placement="auto"``): the router's own ``RoleRebalancer`` and
``RoleBalancer`` decide on virtual time, from the simulated workers' busy time and the tokens' gaps;
a switch drains its worker as ``RoleRebalancer.switch`` does (out of routing until the requests it
holds are done, or ``DRAIN_TIMEOUT_S``) and then flips its role, which takes no time."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.role_balancer import Move, RoleBalancer
from pdserve.router.role_switch import DRAIN_TIMEOUT_S, RoleRebalancer


@dataclass(frozen=True)
class SimSwitch:
    """A switch done at ``at_s`` (virtual seconds) after draining since ``drain_start_s``."""

    at_s: float
    drain_start_s: float
    address: str
    from_role: str
    to_role: str
    reason: str


class SimRoles:
    """The simulator's role switching; ``tick(t)`` runs at each stats poll."""

    def __init__(self, sim, slo_ttft_s: float | None, slo_tpot_s: float | None) -> None:
        self.sim = sim
        balancer = RoleBalancer(slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
        self.rebalancer = RoleRebalancer(sim.pool, balancer, start_s=0.0)
        self.move: Move | None = None
        self.drain_start_s = 0.0
        self.switches: list[SimSwitch] = []

    def tick(self, t: float) -> None:
        if self.move is None:
            self.move = self.rebalancer.decide(t)
            if self.move is not None:
                self.sim.by_address[self.move.address].handle.draining = True
                self.drain_start_s = t
            return
        w = self.sim.by_address[self.move.address]
        if w.handle.active_requests > 0 and t - self.drain_start_s < DRAIN_TIMEOUT_S:
            return
        m, self.move = self.move, None
        self.sim.set_role(w, m.to_role)
        w.handle.draining = False
        self.rebalancer.balancer.switched(t)
        self.switches.append(SimSwitch(t, self.drain_start_s, m.address, m.from_role, m.to_role, m.reason))
