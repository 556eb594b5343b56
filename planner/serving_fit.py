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
  ``f0`` the RPCs and wake-ups between the client and the prefill.
"""

from __future__ import annotations

import statistics

from pdserve.planner.step_model import StepModel, error_stats, fit_relative

SERVING_UNITS = {
    "s0": "s",
    "s1": "s/sequence",
    "r0": "s/request",
    "r1": "s/token",
    "rs": "s/step",
    "k_prefill": "ratio",
    "f0": "s",
}
OPTIONAL = ("k_prefill", "f0", "rs")  # absent from profiles measured before the first-token points
SERVING_FORMULA = (
    "wall per step beyond the engine's predicted time: s0 + s1*b; router and client CPU: r0*requests + "
    "rs*steps + r1*tokens; a lone request's TTFT: r0 + r1 [+ s0 + s1 colocated] + f0 + k_prefill*prefill_s(n)"
)


def predicted_engine_s(model: StepModel, q: dict) -> float:
    """The engine's predicted seconds for a batch point: its prompts' prefill step, then one
    decode step per further token (contexts growing by one a step)."""
    b, n, p = q["batch"], q["output_tokens"], q["prompt_tokens"]
    return model.batch_s([(p, 0)] * b, 0, 0) + sum(model.decode_s(b, b * (p + k)) for k in range(1, n))


def fit_serving(points: list[dict], first_token: list[dict], model: StepModel, placement: str) -> dict:
    """One placement's ``serving`` fit (see the module docstring) of its batch ``points`` and lone
    ``first_token`` points (``prompt_tokens``, ``ttft_s``); each with its error. ValueError with
    fewer than 3 batch points or 2 first-token prompt lengths."""
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
    return {
        "formula": SERVING_FORMULA,
        "placement": placement,
        "coefficients": {name: {"value": v, "unit": SERVING_UNITS[name]} for name, v in values.items()},
        "request_s": request_s,
        "error": error_stats([s0 * r[0] + s1 * r[1] + request_s * r[2] for r in rows], extra),
        "router_cpu_error": error_stats([r0 * a + rs * b + r1 * c for a, b, c in cpu_rows], cpu),
        "first_token_error": error_stats([fixed + f0 + k * model.prefill_s(n) for n in lengths], ttft),
    }
