"""The ``serving`` fits of ``pdserve profile``: what the path around the engine costs, from the
serving probe's points (planner/serving.py) and the engine's fitted step model (``StepModel``).

Per placement (``fits.serving``: colocated; ``fits.serving_split``: a prefill and a decode worker):

- ``s0 + s1*b``: seconds of wall time a step of ``b`` rows takes beyond the engine's *predicted*
  time (``StepModel``): the worker's event loop taking the step's tokens, one gRPC message per
  request and step, the engine thread waiting for the GIL, and whatever makes a serving worker's
  step slower than the profiled engine's. Fitted to ``wall_s - predicted engine`` of the batch
  points as ``s0*steps + s1*b*steps + request_s*b`` (``request_s``: the router admitting the
  burst of ``b`` requests, kept beside the coefficients; the simulator charges it as ``r0``);
- ``r0*requests + rs*steps + r1*tokens``: the router's and the client's CPU (``router_cpu_s``);
  ``rs`` is a worker step's message to the router, ``r1`` each token's relay to its client;
- ``f0 + k_prefill*prefill_s(n)``: the first token of a lone request with an ``n``-token prompt,
  after an idle spell (the first-token points: ``ttft_s`` less ``r0``, ``r1`` and, colocated, the
  step's ``s0 + s1``). ``k_prefill`` is how much longer a prefill step takes in a serving worker
  than in the profile (a worker that was idle; on a prefill worker, the KV streamed beside it) and
  ``f0`` the RPCs and wake-ups between the client and the prefill;
- ``k_prompt_load``, ``k_decode_load``: how much longer a serving worker's steps take under a
  steady load than the engine's predicted time (the median of measured / predicted over the load
  points' traced steps, planner/serving_load.py, ``step_ratios``): steps with a prompt chunk
  (colocated: the colocated workers'; split: the prefill worker's) and decode-only steps
  (colocated; split: the decode worker's); ``cpu_request_load`` and ``cpu_token_load``: the CPU
  seconds the router's process and the load generator spent under that load, per request and per
  output token (the load's two halves, of short and long outputs: a token's is their difference
  over the tokens', a request's the rest of the first half's, its share of the processes' polling
  included). The light in-process client and router of the ``r0``/``rs``/``r1`` fit spend a
  fraction of that.
"""

from __future__ import annotations

import statistics

from pdserve.planner.step_model import StepModel, error_stats, fit_relative
from pdserve.worker.step_trace import step_shape

SERVING_UNITS = {
    "s0": "s",
    "s1": "s/sequence",
    "r0": "s/request",
    "r1": "s/token",
    "rs": "s/step",
    "k_prefill": "ratio",
    "f0": "s",
    "k_prompt_load": "ratio",
    "k_decode_load": "ratio",
    "cpu_request_load": "s/request",
    "cpu_token_load": "s/token",
}
# absent from profiles measured before the first-token points (k_prefill, f0, rs) or the load points
OPTIONAL = ("k_prefill", "f0", "rs", "k_prompt_load", "k_decode_load", "cpu_request_load", "cpu_token_load")
MIN_LOAD_STEPS = 5  # fewer traced steps of a kind than this give no load factor
SERVING_FORMULA = (
    "wall per step beyond the engine's predicted time: s0 + s1*b; router and client CPU: r0*requests + "
    "rs*steps + r1*tokens; a lone request's TTFT: r0 + r1 [+ s0 + s1 colocated] + f0 + k_prefill*prefill_s(n); "
    "under load, steps with a prompt chunk take k_prompt_load x the engine's, decode-only ones k_decode_load x, "
    "and the router and clients spend cpu_request_load + cpu_token_load*tokens of CPU a request"
)


def predicted_engine_s(model: StepModel, q: dict) -> float:
    """The engine's predicted seconds for a batch point: its prompts' prefill step, then one
    decode step per further token (contexts growing by one a step)."""
    b, n, p = q["batch"], q["output_tokens"], q["prompt_tokens"]
    return model.batch_s([(p, 0)] * b, 0, 0) + sum(model.decode_s(b, b * (p + k)) for k in range(1, n))


def step_ratios(steps: list[dict], model: StepModel) -> dict:
    """Measured / predicted (``model.batch_s``) of traced steps (worker/step_trace.py lines):
    ``prompt`` (with a prompt chunk) and ``decode`` (decode rows only), each as ``{"steps",
    "median", "p10", "p90"}``, or None with fewer than ``MIN_LOAD_STEPS`` steps."""
    ratios: dict[str, list[float]] = {"prompt": [], "decode": []}
    for s in steps:
        if s["b"] or s["chunks"]:
            predicted = model.batch_s(*step_shape(s))
            ratios["prompt" if s["chunks"] else "decode"].append((s["t1"] - s["t0"]) / 1e9 / predicted)
    out = {}
    for kind, r in ratios.items():
        r.sort()
        q = statistics.quantiles(r, n=10) if len(r) >= MIN_LOAD_STEPS else None
        out[kind] = {"steps": len(r), "median": statistics.median(r), "p10": q[0], "p90": q[-1]} if q else None
    return out


def fit_serving(
    points: list[dict], first_token: list[dict], model: StepModel, placement: str, load: dict | None = None
) -> dict:
    """One placement's ``serving`` fit (see the module docstring) of its batch ``points``, lone
    ``first_token`` points (``prompt_tokens``, ``ttft_s``) and ``load`` points
    (``serving_load.measure_load``; None: no load coefficients); each with its error. ValueError
    with fewer than 3 batch points or 2 first-token prompt lengths."""
    if len(points) < 3:
        raise ValueError(f"the serving fit needs at least 3 batch points, got {len(points)}")
    lengths = sorted({q["prompt_tokens"] for q in first_token})
    if len(lengths) < 2:
        raise ValueError(f"the serving fit needs first-token points at 2 prompt lengths or more, got {lengths}")
    rows = [[q["steps"], q["batch"] * q["steps"], q["batch"]] for q in points]
    extra = [max(1e-6, q["wall_s"] - predicted_engine_s(model, q)) for q in points]  # the fit wants > 0
    s0, s1, request_s = fit_relative(rows, extra)
    cpu = [q["router_cpu_s"] for q in points]
    cpu_rows = [[q["batch"], q["steps"], q["batch"] * q["output_tokens"]] for q in points]
    r0, rs, r1 = fit_relative(cpu_rows, cpu)
    fixed = r0 + r1 + (s0 + s1 if placement == "colocated" else 0.0)
    ttft = [statistics.median(q["ttft_s"] for q in first_token if q["prompt_tokens"] == n) for n in lengths]
    f0, k = fit_relative([[1.0, model.prefill_s(n)] for n in lengths], [max(1e-6, t - fixed) for t in ttft])
    values = {"s0": s0, "s1": s1, "r0": r0, "r1": r1, "rs": rs, "k_prefill": k, "f0": f0}
    steps = load["steps"] if load else {}
    roles = ("colocated", "colocated") if placement == "colocated" else ("prefill", "decode")
    for kind, role in zip(("prompt", "decode"), roles):
        ratio = step_ratios(steps[role], model)[kind] if role in steps else None
        if ratio:
            values[f"k_{kind}_load"] = ratio["median"]
    if load:
        values["cpu_request_load"], values["cpu_token_load"] = load_cpu(load["halves"])
    return {
        "formula": SERVING_FORMULA,
        "placement": placement,
        "coefficients": {name: {"value": v, "unit": SERVING_UNITS[name]} for name, v in values.items()},
        "request_s": request_s,
        "error": error_stats([s0 * r[0] + s1 * r[1] + request_s * r[2] for r in rows], extra),
        "router_cpu_error": error_stats([r0 * a + rs * b + r1 * c for a, b, c in cpu_rows], cpu),
        "first_token_error": error_stats([fixed + f0 + k * model.prefill_s(n) for n in lengths], ttft),
        "load": _load_summary(load, model) if load else None,
    }


def load_cpu(halves: list[dict]) -> tuple[float, float]:
    """Router and client CPU seconds per request and per output token from the load's two halves
    (``serving_load.measure_load``; module docstring), each >= 0."""
    (a, b), cpu = halves, [h["router_cpu_s"] + h["client_cpu_s"] for h in halves]
    per_token = max(0.0, (cpu[1] / b["requests"] - cpu[0] / a["requests"])) / max(
        1e-9, b["output_tokens"] / b["requests"] - a["output_tokens"] / a["requests"]
    )
    return max(0.0, (cpu[0] - per_token * a["output_tokens"]) / a["requests"]), per_token


def _load_summary(load: dict, model: StepModel) -> dict:
    """The load points as the profile keeps them: the rate, each half (requests, tokens, wall time
    and the cores the router and the client kept busy), and each role's step ratios."""
    return {
        "rate_rps": load["rate_rps"],
        "halves": [
            {
                **{k: h[k] for k in ("requests", "output_tokens", "wall_s")},
                "router_cores": h["router_cpu_s"] / h["wall_s"],
                "client_cores": h["client_cpu_s"] / h["wall_s"],
            }
            for h in load["halves"]
        ],
        "steps": {role: step_ratios(steps, model) for role, steps in load["steps"].items()},
    }
