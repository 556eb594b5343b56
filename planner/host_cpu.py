"""What the simulator charges beyond the engine's steps: the serving path's time per step and per
token (``ServingModel``, the ``serving`` fit of ``pdserve profile``) and, when the workers share a
machine's cores with the router and the load generator, the slowdown of that sharing (``HostCpu``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from pdserve.planner.serving import SERVING_UNITS

ROUTER_WINDOW_S = 0.5  # the router's CPU use is averaged over this much of the recent past


@dataclass(frozen=True)
class ServingModel:
    """``s0 + s1*b`` seconds a worker's step of ``b`` token rows takes beyond the engine's
    compute, and ``r0`` seconds of router and client CPU per request and ``r1`` per token
    (planner/serving.py measures them). All zero: the engine's steps only."""

    s0: float = 0.0
    s1: float = 0.0
    r0: float = 0.0
    r1: float = 0.0

    def step_extra_s(self, rows: int) -> float:
        """Seconds the serving path adds to a step that emits ``rows`` tokens."""
        return self.s0 + self.s1 * rows if rows else 0.0

    @classmethod
    def from_profile(cls, profile: dict) -> ServingModel | None:
        """The profile's ``fits.serving``, or None when it has none (a profile written with
        ``--no-serving``). ValueError when the section is there but lacks a coefficient."""
        fit = profile.get("fits", {}).get("serving")
        if fit is None:
            return None
        coefs = fit.get("coefficients") if isinstance(fit, dict) else None
        values = {}
        for name in SERVING_UNITS:
            c = coefs.get(name) if isinstance(coefs, dict) else None
            if not isinstance(c, dict) or "value" not in c:
                raise ValueError(f"profile has no coefficient fits.serving.coefficients.{name}")
            v = c["value"]
            if not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"profile coefficient fits.serving.coefficients.{name} must be >= 0, got {v!r}")
            values[name] = float(c["value"])
        return cls(**values)


class HostCpu:
    """The cores that the workers (``threads`` each while they compute), the router and the load
    generator (``serving.r0`` / ``r1`` of CPU per request / token, averaged over the last
    ``ROUTER_WINDOW_S``) share. ``cores`` 0: each worker has cores of its own and the router and
    clients run elsewhere, so nothing slows down. When the demand exceeds the cores, every step
    stretches by demand / cores (fair sharing of the cores, as the OS scheduler does)."""

    def __init__(self, cores: float, serving: ServingModel | None) -> None:
        if cores < 0:
            raise ValueError(f"host cores must be >= 0, got {cores}")
        self.cores, self.serving = cores, serving or ServingModel()
        self._router: collections.deque[tuple[float, float]] = collections.deque()  # (time s, CPU s)
        self._router_sum = 0.0

    def charge_router(self, t: float, cpu_s: float) -> None:
        """Router and client CPU spent at ``t`` (virtual seconds)."""
        if self.cores and cpu_s > 0:
            self._router.append((t, cpu_s))
            self._router_sum += cpu_s

    def router_load(self, t: float) -> float:
        """Cores the router and the clients kept busy over the window before ``t``."""
        while self._router and self._router[0][0] <= t - ROUTER_WINDOW_S:
            self._router_sum -= self._router.popleft()[1]
        return max(0.0, self._router_sum) / ROUTER_WINDOW_S

    def stretch(self, t: float, busy_threads: int) -> float:
        """The factor (>= 1) by which work started at ``t`` runs slower than alone, with
        ``busy_threads`` worker threads computing."""
        if not self.cores:
            return 1.0
        return max(1.0, (busy_threads + self.router_load(t)) / self.cores)
