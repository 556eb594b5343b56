"""What the simulator charges beyond the engine's steps: the serving path's time per step, per token,
per prompt and per first token (``ServingModel``, one for each path a request takes:
``ServingPaths``, the ``serving`` and ``serving_split`` fits of ``pdserve profile``) and, when the
workers share a machine's cores with the router and the load generator, the slowdown of that sharing
(``HostCpu``).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

from pdserve.planner.serving_fit import OPTIONAL, SERVING_UNITS
from pdserve.planner.virtual_runner import StepFactors

ROUTER_WINDOW_S = 0.5  # the router's CPU use is averaged over this much of the recent past
MAX_RATIO = 100.0  # a serving step 100x the profiled engine's is no measurement of this machine


@dataclass(frozen=True)
class ServingModel:
    """One serving path (planner/serving_fit.py measures it): ``s0 + s1*b`` seconds a worker's step
    of ``b`` token rows takes beyond the engine's predicted time; ``r0`` seconds of router and
    client CPU per request, ``rs`` per worker step with tokens and ``r1`` per token; prefill steps
    take ``k_prefill`` times the engine's predicted time alone, ``k_prompt_load`` times under load
    (None: ``k_prefill``), and decode-only steps ``k_decode_load`` times (``StepFactors``); a
    request's first token reaches its client ``f0`` seconds after what the rest accounts for (the
    RPCs and wake-ups around a prefill); the router and the clients spend ``cpu_s`` of CPU. The
    defaults: the engine's steps only."""

    s0: float = 0.0
    s1: float = 0.0
    r0: float = 0.0
    r1: float = 0.0
    rs: float = 0.0
    k_prefill: float = 1.0
    f0: float = 0.0
    k_prompt_load: float | None = None
    k_decode_load: float = 1.0
    cpu_request_load: float | None = None
    cpu_token_load: float | None = None

    @functools.cached_property  # read for every simulated token
    def cpu_s(self) -> tuple[float, float, float]:
        """Router and client CPU seconds per (request, worker step, token) that ``HostCpu`` charges:
        ``cpu_request_load`` and ``cpu_token_load`` when measured (everything under load), else
        ``r0``, ``rs``, ``r1``."""
        if self.cpu_token_load is None:
            return self.r0, self.rs, self.r1
        return self.cpu_request_load or 0.0, 0.0, self.cpu_token_load

    def step_extra_s(self, rows: int) -> float:
        """Seconds the serving path adds to a step that emits ``rows`` tokens."""
        return self.s0 + self.s1 * rows if rows else 0.0

    @classmethod
    def from_profile(cls, profile: dict, section: str = "serving") -> ServingModel | None:
        """The profile's ``fits.<section>``, or None when it has none (a profile written with
        ``--no-serving``). ValueError when the section is there but lacks a coefficient or holds one
        no machine measures; ``k_prefill``, ``f0``, ``rs``, ``k_prompt_load``, ``k_decode_load`` and
        the ``cpu_*_load`` may be absent (a profile that does not measure them): 1, 0, 0,
        ``k_prefill``, 1 and None."""
        fit = profile.get("fits", {}).get(section)
        if fit is None:
            return None
        coefs = fit.get("coefficients") if isinstance(fit, dict) else None
        if not isinstance(coefs, dict):
            raise ValueError(f"profile has no fits.{section}.coefficients object")
        values = {}
        for name in SERVING_UNITS:
            c = coefs.get(name)
            if c is None and name in OPTIONAL:
                continue
            where = f"fits.{section}.coefficients.{name}"
            if c is None:
                raise ValueError(f"profile has no coefficient {where}")
            if not isinstance(c, dict) or "value" not in c:
                shape = '{"value": ..., "unit": ...}'
                raise ValueError(f"profile coefficient {where} must be an object {shape}, got {c!r}")
            v = c["value"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"profile coefficient {where} must be a number >= 0, got {v!r}")
            # a ratio to the engine's time; a load ratio is a median of measured steps, never 0
            if SERVING_UNITS[name] == "ratio" and (v > MAX_RATIO or (v == 0 and name.endswith("_load"))):
                low = "> 0" if name.endswith("_load") else ">= 0"
                raise ValueError(f"profile coefficient {where} is a ratio to the engine's: {low}, <= {MAX_RATIO:g}")
            values[name] = float(v)
        return cls(**values)


@dataclass(frozen=True)
class ServingPaths:
    """The serving path of a request prefilled where it decodes (``colocated``: a colocated worker,
    or a decode worker prefilling locally) and of one prefilled on a prefill worker (``split``)."""

    colocated: ServingModel
    split: ServingModel

    @classmethod
    def of(cls, serving: ServingModel | ServingPaths | None) -> ServingPaths:
        """``serving`` as paths: one model serves both; None: the engine's steps only."""
        if isinstance(serving, ServingPaths):
            return serving
        m = serving or ServingModel()
        return cls(m, m)

    @classmethod
    def from_profile(cls, profile: dict) -> ServingPaths | None:
        """``fits.serving`` (colocated) and ``fits.serving_split`` (split; the colocated one where a
        profile lacks it), or None without a ``serving`` section. ValueError as
        ``ServingModel.from_profile``."""
        colocated = ServingModel.from_profile(profile)
        if colocated is None:
            return None
        return cls(colocated, ServingModel.from_profile(profile, "serving_split") or colocated)

    def step_factors(self, role: str, local: bool = False) -> StepFactors:
        """A worker of ``role``'s steps against the engine's predicted time: a prefill worker's
        prompts the split path's factors (its KV sends are charged apart, ``SimWorker.send_kv``); a
        colocated or decode worker's prompts the colocated path's, its decode-only steps its own
        path's ``k_decode_load`` (a decode worker that prefills its own prompts, ``local``: the
        colocated path's, whose workers' decode steps follow prompt steps)."""
        p = self.split if role == "prefill" else self.colocated
        loaded = p.k_prefill if p.k_prompt_load is None else p.k_prompt_load
        decode = (self.colocated if role == "colocated" or local else self.split).k_decode_load
        return StepFactors(p.k_prefill, loaded, decode)


class HostCpu:
    """The cores that the workers (``threads`` each while they compute), the router and the load
    generator (``ServingModel.cpu_s`` of CPU per request / step / token, averaged over the last
    ``ROUTER_WINDOW_S``) share. ``cores`` 0: each worker has cores of its own and the router and
    clients run elsewhere, so nothing slows down. When the demand exceeds the cores, every step
    stretches by demand / cores (fair sharing of the cores, as the OS scheduler does)."""

    def __init__(self, cores: float) -> None:
        if cores < 0:
            raise ValueError(f"host cores must be >= 0, got {cores}")
        self.cores = cores
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
