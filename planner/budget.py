"""How long ``pdserve profile`` will take, and its grid cut to a time budget (``--time-budget``).

Before the measurements, a few calibration steps (``calibrate``: three prompt lengths and three
decode batches, two runs each, the faster kept) give rough step times. ``estimate_s`` adds up what
the grid's points cost (each point's warm-up and timed runs in every pass) and what the serving
section costs (``ServingPlan``: starting its processes, its batch and first-token requests, its
load's send times and tails). ``fit_budget`` then drops the largest value of one axis at a time,
the axis whose largest value costs most first, until the estimate fits the budget, every axis is
down to what the fits need (``KEEP``), or what is left to drop saves under ``MIN_SAVING`` of it.
Values the user set are never dropped; each value dropped is a note in the profile's
``settings.skipped``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from pdserve.planner.grid import Grid, Limits, batched_points, cached_points, decode_points, mixed_points
from pdserve.planner.step_model import StepModel, fit_relative

# Each axis that may be cut: the fewest values it keeps (the fits need 3 prompt lengths and 3
# decode batches), and what a dropped value was, for its note.
KEEP = {
    "prefill_tokens": (3, "prompt steps of {} tokens"),
    "cached_tokens": (1, "cached prefixes of {} tokens"),
    "cached_with": (1, "prompts of {} tokens after a cached prefix"),
    "batched_prompts": (1, "steps of {} prompts at once"),
    "batched_tokens": (1, "steps of several prompts of {} tokens each"),
    "batch_sizes": (3, "decode batches of {} sequences"),
    "context_lens": (2, "decode contexts of {} tokens"),
    "mixed_prompt_tokens": (1, "mixed steps' prompt chunks of {} tokens"),
    "mixed_batch_sizes": (1, "mixed steps beside {} decoding sequences"),
    "mixed_contexts": (1, "mixed steps beside contexts of {} tokens"),
    "first_token_prompts": (2, "first-token requests of {} prompt tokens"),
}
PROCESS_START_S = 5.0  # a spawned process's interpreter and imports (torch, grpc), before its own work
SERVING_STEP_S = 0.01  # a serving step's time beyond the engine's (gRPC, the router's relay)
# A value whose points cost less than this share of the budget is kept (unless the estimate is past the
# budget by less): dropping it would save nothing worth its points.
MIN_SAVING = 0.01
HANDOFF_S = 5.0  # the hand-off section: a decode worker on loopback and its transfers
CALIBRATE_PROMPTS = (32, 128, 512)
CALIBRATE_DECODES = ((1, 64), (16, 64), (16, 512))


@dataclass(frozen=True)
class Costs:
    """Rough costs from the calibration (``calibrate``): ``steps``, step times; ``admit_s``, seconds
    to admit a token of random KV (a decode point's sequences, once a pass); ``worker_start_s``,
    seconds to load the engine (a serving worker does it after ``PROCESS_START_S``)."""

    steps: StepModel
    admit_s: float
    worker_start_s: float


@dataclass(frozen=True)
class ServingPlan:
    """What the serving section of ``pdserve profile`` runs for each placement
    (planner/serving.py): batch points of each of ``batches`` x ``outputs`` tokens after
    ``prompt_tokens``-token prompts; ``first_token_repeats`` (+1 warm-up) lone requests of each of
    ``first_token_prompts`` tokens, ``gap_s`` seconds apart; a load of ``load_requests`` requests of
    ``load_prompt`` tokens at ``load_rates`` (requests a second, one per placement) whose halves
    read ``load_outputs`` tokens each."""

    batches: tuple[int, ...]
    outputs: tuple[int, ...]
    prompt_tokens: int
    first_token_prompts: tuple[int, ...]
    first_token_repeats: int
    gap_s: float
    load_requests: int
    load_prompt: int
    load_outputs: tuple[int, ...]
    load_rates: tuple[float, ...]

    @classmethod
    def from_dict(cls, d: dict) -> ServingPlan:
        """The plan from its ``asdict`` (as the profile's ``settings.serving_plan`` keeps it)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def seconds(self, costs: Costs) -> float:
        """Estimated seconds of the whole serving section under ``costs``."""
        m = costs.steps
        batch = sum(
            n * (m.decode_s(b, b * (self.prompt_tokens + n / 2)) + SERVING_STEP_S)
            for b in self.batches
            for n in self.outputs
        )
        first = sum(
            (self.first_token_repeats + 1) * (self.gap_s + m.prefill_s(n) + m.decode_s(1, n))
            for n in self.first_token_prompts
        )
        # a load half ends with its last request: a prompt, then its tokens beside the others'
        prompt = self.load_prompt
        tails = sum(m.prefill_s(prompt) + n * m.decode_s(2, 2 * (prompt + n)) for n in self.load_outputs)
        starts = 2 * costs.worker_start_s + 4 * PROCESS_START_S  # the workers twice, the load's router and client
        return sum(batch + first + self.load_requests / rate + tails + starts for rate in self.load_rates)


def calibrate(st, lim: Limits, worker_start_s: float) -> Costs:
    """Rough costs from a few steps of the profile's ``Stepper`` ``st`` (prompts and decode
    batches cut to what ``lim`` holds): prefill ``p0 + p1*n + p3*n^2``, decode ``d0 + d1*b +
    d2*total_context`` seconds, by the same non-negative fit as the profile's model, and the time
    to admit a decode batch's KV."""
    lengths = sorted({min(n, lim.budget, lim.room - 1) for n in CALIBRATE_PROMPTS})
    pre = [min(st.prompts([st.ids(n)], 0) for _ in range(2)) for n in lengths]
    if len(lengths) == 3:
        p0, p1, p3 = fit_relative([[1, n, n * n] for n in lengths], pre)
    else:  # a tiny context window: every prompt step is short, charged at the longest's rate
        p0, p1, p3 = 0.0, pre[-1] / lengths[-1], 0.0
    dec, shapes, admit_s, admitted = [], [], 0.0, 0
    for b, n in CALIBRATE_DECODES:
        b, n = min(b, lim.rows), min(n, lim.room - st.grid.decode_margin)
        if n < 1 or b * lim.blocks_for(n + st.grid.decode_margin) > lim.blocks or (b, n) in shapes:
            continue
        t = time.perf_counter()
        seqs = st.admit(b, n)
        admit_s, admitted = admit_s + time.perf_counter() - t, admitted + b * n
        dec.append(min(st.step(b) for _ in range(2)))
        st.finish(seqs)
        shapes.append((b, n))
    if len(shapes) == 3:
        d0, d1, d2 = fit_relative([[1, b, b * n] for b, n in shapes], dec)
    else:  # a tiny KV cache: charge every decode step the slowest step measured
        d0, d1, d2 = max(dec, default=0.0), 0.0, 0.0
    steps = StepModel(p0, p1, 0.0, p3, d0, d1, d2, 0.0, 0.0, 0.0, math.inf)
    return Costs(steps, admit_s / max(admitted, 1), worker_start_s)


def _runs(g: Grid) -> int:
    """Runs of each point over the whole profile: every pass's warm-up and timed runs."""
    return len(g.pass_repeats()) * g.warmup + g.repeats


def steps_s(g: Grid, lim: Limits, costs: Costs) -> float:
    """Estimated seconds of the step sections and the hand-off for grid ``g``."""
    m, passes, margin = costs.steps, len(g.pass_repeats()), g.decode_margin / 2
    cached = cached_points(g, lim)
    pre = sum(m.prefill_s(n) for n in g.prefill_tokens) + sum(m.prefill_s(n, c) for n, c in cached)
    pre += sum(m.p0 + k * (m.prefill_s(n) - m.p0) for k, n in batched_points(g, lim))
    prefixes = sum(m.prefill_s(c) for c in {c for _, c in cached})  # each cached prefix, once a pass
    dec = [(b, b * (n + margin)) for b, n in decode_points(g, lim)]
    mix = [(p, d, d * (n + margin)) for p, d, n in mixed_points(g, lim)]
    step = sum(m.decode_s(b, t) for b, t in dec) + sum(m.prefill_s(p) + m.decode_s(d, t) - m.d0 for p, d, t in mix)
    admits = costs.admit_s * (sum(t for _, t in dec) + sum(t for _, _, t in mix))
    return _runs(g) * (pre + step) + passes * (prefixes + admits) + HANDOFF_S


def estimate_s(g: Grid, lim: Limits, costs: Costs, serving: ServingPlan | None) -> float:
    """Estimated seconds of the whole profile after calibration: the steps and, when ``serving``
    is given, the serving section."""
    return steps_s(g, lim, costs) + (serving.seconds(costs) if serving else 0.0)


def over_budget(estimate: float, budget_s: float | None, serving: ServingPlan | None, costs: Costs) -> str:
    """What to tell a user whose budget the cut grid still misses ("" when it fits)."""
    if budget_s is None or estimate <= budget_s:
        return ""
    alone = ""
    if serving is not None:
        alone = f"; the serving section alone is about {serving.seconds(costs):.0f} s (--no-serving leaves it out)"
    return f"; past the budget with every axis cut to what its fit needs{alone}"


def fit_budget(
    g: Grid,
    lim: Limits,
    costs: Costs,
    budget_s: float | None,
    serving: ServingPlan | None,
    explicit: set[str] = frozenset(),
) -> tuple[Grid, ServingPlan | None, list[str]]:
    """``g`` and ``serving`` with their largest values dropped (module docstring) until the
    estimate (``estimate_s``) is at most ``budget_s`` seconds (None: no budget), and a note for
    each value dropped. Fields in ``explicit`` (the user's) keep every value."""
    notes: list[str] = []
    if budget_s is None:
        return g, serving, notes

    def total(grid: Grid, plan: ServingPlan | None) -> float:
        return estimate_s(grid, lim, costs, plan)

    while (now := total(g, serving)) > budget_s:
        options = []
        for field, (keep, _) in KEEP.items():
            owner = serving if field == "first_token_prompts" else g
            if field in explicit or owner is None or len(getattr(owner, field)) <= keep:
                continue
            values = getattr(owner, field)
            cut = replace(owner, **{field: values[:-1]})
            saved = now - (total(g, cut) if owner is serving else total(cut, serving))
            options.append((saved, field, cut, values[-1]))
        options = [o for o in options if o[0] > 0 and o[0] >= min(MIN_SAVING * budget_s, now - budget_s)]
        if not options:
            break
        saved, field, cut, value = max(options, key=lambda o: o[0])
        if field == "first_token_prompts":
            serving = cut
        else:
            g = cut
        what = KEEP[field][1].format(value)
        notes.append(f"{what}: past --time-budget {budget_s:g} s (about {saved:.0f} s of the estimate)")
    return g, serving, notes
