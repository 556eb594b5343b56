"""Placement search (``pdserve plan``): for each candidate unit (the largest group of colocated
workers, or of a P:D ratio's ``p + d``, that fits in ``min(N, max_unit)`` workers), find the highest
request rate at which the simulated SLO attainment stays at or above a target, as DistServe's
placement search does, and rank the candidates by goodput per worker (that rate x attainment / unit
size).

Units are groups, not the smallest unit of each ratio, because one router pools its workers: a
request goes to whichever is free. A lone colocated worker queues a request behind the prompt it is
computing, two pooled ones seldom do, and with a TTFT SLO near a prompt's prefill time that is most
of the capacity: W2 on a 2-core AMD EPYC (TTFT SLO 1.5x a lone prefill) gave 0.146 req/s a worker
as units of 1, while two pooled workers served 0.52 req/s at 0.6 offered (docs/measurements.md).

Every probe runs ``Simulator`` (``planner/simulate.py``) and reads attainment from the bench's own
``summarize``. A cluster of N workers is taken to be ``floor(N / unit)`` independent units (the
scaling assumption: units share nothing, so goodput adds up; the ``N mod unit`` left over idle).
With ``host_cores_per_worker`` (the workers share a machine's cores with the router and the load
generator: ``--host-cores`` / N), a unit of ``k`` workers gets ``k`` times that share of the cores
and carries its share of the router's work (``HostCpu``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.params import SamplingParams
from pdserve.loadgen.metrics import SLO, summarize
from pdserve.loadgen.workload import RequestSpec
from pdserve.planner.host_cpu import ServingPaths
from pdserve.planner.simulate import SimConfig, Simulator
from pdserve.planner.step_model import StepModel

DEFAULT_LOCAL_PREFILL = (0, 32, 256)
DEFAULT_MAX_NUM_SEQS = (16, 64)
DEFAULT_MAX_UNIT = 4
MAX_UNIT = 8
DEFAULT_START_RATE = 1.0  # req/s per worker of the unit, the search's first probe
SCALING_NOTE = "a cluster of N workers = floor(N / unit) independent units (leftover workers idle)"


@dataclass(frozen=True)
class Candidate:
    placement: str  # split | colocated
    num_prefill: int  # colocated: the colocated workers (each prefills and decodes its own requests)
    num_decode: int  # colocated: 0
    local_prefill_tokens: int
    max_num_seqs: int

    @property
    def unit(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def label(self) -> str:
        if self.placement == "colocated":
            return f"colocated {self.num_prefill} seqs={self.max_num_seqs}"
        return f"{self.num_prefill}:{self.num_decode} lp={self.local_prefill_tokens} seqs={self.max_num_seqs}"


def ratios(max_unit: int) -> list[tuple[int, int]]:
    """Every P:D ratio in lowest terms whose unit ``p + d`` is at most ``max_unit`` (1:1 first)."""
    out = [(p, s - p) for s in range(2, max_unit + 1) for p in range(1, s) if math.gcd(p, s - p) == 1]
    return sorted(out, key=lambda r: (r[0] + r[1], -r[0]))


def candidates(
    num_workers: int,
    max_unit: int = DEFAULT_MAX_UNIT,
    local_prefill: tuple[int, ...] = DEFAULT_LOCAL_PREFILL,
    max_num_seqs: tuple[int, ...] = DEFAULT_MAX_NUM_SEQS,
    only_ratios: list[tuple[int, int]] | None = None,
) -> list[Candidate]:
    """``cap = min(num_workers, max_unit)`` colocated workers, and every split ratio ``p:d`` with
    ``p + d <= cap`` as its largest multiple that fits in ``cap`` workers (1:1 at a cap of 4: 2:2),
    each with every ``max_num_seqs`` (and for split, every ``local_prefill``): units of about the
    same size pool their requests alike (module docstring). ValueError for N < 1."""
    if num_workers < 1:
        raise ValueError(f"--workers must be at least 1, not {num_workers}")
    cap = min(num_workers, max_unit)
    pairs = [r for r in (only_ratios or ratios(cap)) if r[0] + r[1] <= cap and min(r) >= 1]
    groups = [(p * (cap // (p + d)), d * (cap // (p + d))) for p, d in pairs]
    out = [Candidate("colocated", cap, 0, 0, s) for s in max_num_seqs]
    out += [Candidate("split", p, d, lp, s) for p, d in groups for lp in local_prefill for s in max_num_seqs]
    return out


def scaled(specs: list[RequestSpec], factor: float, count: int | None = None) -> list[RequestSpec]:
    """The first ``count`` of ``specs`` sent ``factor`` times as fast (send times divided by it);
    past ``len(specs)`` they repeat in turn (each round after the last, one mean gap later)."""
    count = count or len(specs)
    period = specs[-1].send_at_s + specs[-1].send_at_s / max(len(specs) - 1, 1) if specs else 0.0
    out = []
    for i in range(count):
        s = specs[i % len(specs)]
        t = s.send_at_s + (i // len(specs)) * period
        out.append(dataclasses.replace(s, index=i, send_at_s=t / factor))
    return out


class Planner:
    """Searches ``Candidate`` units with ``specs`` built at 1 req/s (the arrival process of the
    workload; a probe at rate R divides their send times by R)."""

    def __init__(self, engine: EngineConfig, model: StepModel, dtype: str, slo: SLO, attainment: float = 0.9,
                 routing: str = "prefix-aware", max_requests_per_worker: int = 512, search_steps: int = 4,
                 rates: list[float] | None = None, max_requests: int = 100, serving: ServingPaths | None = None,
                 host_cores_per_worker: float = 0.0, min_requests: int | None = None) -> None:  # fmt: skip
        self.engine, self.model, self.dtype, self.slo = engine, model, dtype, slo
        self.serving, self.host_cores_per_worker = serving, host_cores_per_worker
        self.attainment, self.routing, self.bound = attainment, routing, max_requests_per_worker
        self.search_steps, self.rates = search_steps, sorted(rates) if rates else None
        self.simulations, self.max_requests, self.min_requests = 0, max_requests, min_requests

    def count(self, specs: list[RequestSpec], rate: float) -> int:
        """Requests of a probe at ``rate``: enough to span twice a request's SLO budget (TTFT + TPOT
        x mean output) so that a queue can build, at least ``min_requests`` (None: ``len(specs)``),
        at most ``max_requests``."""
        floor = len(specs) if self.min_requests is None else min(self.min_requests, len(specs))
        return max(floor, min(self.max_requests, self._wanted(specs, rate)))

    def _wanted(self, specs: list[RequestSpec], rate: float) -> int:
        """Requests at ``rate`` that span twice a request's SLO budget (TTFT + TPOT x mean output)."""
        mean_out = sum(s.max_tokens for s in specs) / len(specs)
        return math.ceil(rate * 2 * (self.slo.ttft_s + self.slo.tpot_s * mean_out))

    def capped(self, specs: list[RequestSpec], rate: float) -> bool:
        """Whether ``max_requests`` cut a probe at ``rate`` short of the span ``count`` asks for (a
        queue may not build in it, so the rate found may be too high)."""
        return self._wanted(specs, rate) > self.max_requests

    def check_fits(self, specs: list[RequestSpec]) -> None:
        """ValueError (one line) when a request cannot run on the model (too long, KV too small)."""
        eng = Simulator(SimConfig(self.engine, "colocated", 1, 0), self.model, self.dtype).workers[0].engine
        for s in specs:
            try:
                eng.check_request(list(s.prompt_token_ids), SamplingParams(max_tokens=s.max_tokens, ignore_eos=True))
            except ValueError as exc:
                raise ValueError(f"the workload cannot fit the model: request {s.index}: {exc}") from None

    def probe(self, cand: Candidate, specs: list[RequestSpec], rate: float) -> dict:
        """The bench summary of ``specs`` at ``rate`` req/s on one unit of ``cand``."""
        engine = dataclasses.replace(self.engine, max_num_seqs=cand.max_num_seqs)
        cfg = SimConfig(
            engine,
            cand.placement,
            cand.num_prefill,
            cand.num_decode,
            self.routing,
            cand.local_prefill_tokens,
            self.bound,
            host_cores=self.host_cores_per_worker * (cand.num_prefill + cand.num_decode),
        )
        self.simulations += 1
        sim = Simulator(cfg, self.model, self.dtype, self.serving)
        return summarize(sim.run(scaled(specs, rate, self.count(specs, rate))), self.slo)

    def _ok(self, summary: dict) -> bool:
        return summary["slo_attainment"] >= self.attainment

    def search(self, cand: Candidate, specs: list[RequestSpec]) -> dict:
        """The highest rate (req/s per unit) meeting the attainment target, and its figures:
        with ``rates``, the last of the ascending sweep before the first miss; otherwise doubling
        (or halving) from ``DEFAULT_START_RATE`` x unit to bracket it, then ``search_steps`` bisections."""
        best: tuple[float, dict] | None = None
        ceiling = False  # every rate the doubling probed met the SLO
        if self.rates:
            for r in self.rates:
                s = self.probe(cand, specs, r)
                if not self._ok(s):
                    break
                best = (r, s)
        else:
            lo, hi, r = None, None, DEFAULT_START_RATE * cand.unit
            for _ in range(16):  # bracket [lo passes, hi fails]
                s = self.probe(cand, specs, r)
                if self._ok(s):
                    best, lo = (r, s), r
                    if hi is not None:
                        break
                    r *= 2
                else:
                    hi = r
                    if lo is not None:
                        break
                    r /= 2
            for _ in range(self.search_steps if lo is not None and hi is not None else 0):
                mid = (lo * hi) ** 0.5
                s = self.probe(cand, specs, mid)
                if self._ok(s):
                    best, lo = (mid, s), mid
                else:
                    hi = mid
            ceiling = hi is None and best is not None
        capped = best is not None and self.capped(specs, best[0])
        return {**result(cand, best), "search_ceiling": ceiling, "probe_capped": capped}

    def run(self, cands: list[Candidate], specs: list[RequestSpec], num_workers: int) -> list[dict]:
        """Every candidate's figures, best first (predicted goodput of ``num_workers``, then per worker)."""
        self.check_fits(specs)
        rows = [self.search(c, specs) for c in cands]
        for row in rows:
            units = num_workers // row["unit"]
            row["units"] = units
            row["cluster_goodput_rps"] = row["goodput_per_unit_rps"] * units
            row["workers"] = workers_of(row, units)
        rows.sort(key=lambda r: (-r["cluster_goodput_rps"], -r["goodput_per_worker_rps"], r["unit"]))
        return rows


def result(cand: Candidate, best: tuple[float, dict] | None) -> dict:
    rate, s = best if best else (0.0, {})
    att = s.get("slo_attainment", 0.0)
    return {
        "label": cand.label,
        **dataclasses.asdict(cand),
        "unit": cand.unit,
        "max_rate_rps": rate,
        "slo_attainment": att,
        "goodput_per_unit_rps": rate * att,
        "goodput_per_worker_rps": rate * att / cand.unit,
        "ttft_p90_ms": s.get("ttft_p90_s", math.nan) * 1e3,
        "tpot_p50_ms": s.get("tpot_p50_s", math.nan) * 1e3,
    }


def workers_of(row: dict, units: int) -> dict:
    """Workers per role of ``units`` units of ``row``'s candidate."""
    if row["placement"] == "colocated":
        return {"colocated": row["num_prefill"] * units}
    return {"prefill": row["num_prefill"] * units, "decode": row["num_decode"] * units}


def first_roles(doc: dict, num_workers: int | None = None) -> tuple[int, int]:
    """(prefill, decode) workers an auto placement starts with, from a plan.json document (``pdserve
    plan``): its best candidate's roles, a colocated worker counted as a decode worker that prefills
    its own requests, and any worker the plan leaves idle as decode. ``num_workers`` (default: the
    plan's) scales the best unit to another cluster size. ValueError for a document that is not a
    plan or a size below the unit."""
    if not isinstance(doc, dict):
        raise ValueError(f"not a plan written by pdserve plan (a JSON {type(doc).__name__}, not an object)")
    try:
        best, planned = doc["best"], int(doc["workers"])
        placement, unit = best["placement"], int(best["unit"])
        p, d = (0, 1) if placement == "colocated" else (int(best["num_prefill"]), int(best["num_decode"]))
    except (KeyError, TypeError, ValueError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else f"a bad value: {exc}"
        raise ValueError(f"not a plan written by pdserve plan ({what})") from None
    n = num_workers or planned
    if n < unit:
        raise ValueError(
            f"the plan's best unit {best.get('label', placement)!r} needs {unit} workers, "
            f"not {n} (--prefill + --decode)"
        )
    units = n // unit
    return p * units, n - p * units
