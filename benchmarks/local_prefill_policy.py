#!/usr/bin/env python3
"""Where the load-aware local-prefill rule's thresholds come from: simulated goodput of split 1 + 1
for each ``busy_prefill_tokens`` value (and the ``prefix`` policy alone) at each rate, side by side.

    python benchmarks/local_prefill_policy.py --profile profile.json [--rates 4,8,16,24,32] \\
        [--busy 256,512,1024,2048] [--num-requests 400] [--input-len 256] [--output-len 64]

Runs ``pdserve.planner.simulate.Simulator`` (the router's own ``local_prefill_reason`` on simulated
workers whose steps take the profile's times) on W2-shaped requests (Poisson arrivals, random
prompts, EOS ignored), scores them at ``--slo-ttft-ms`` / ``--slo-tpot-ms`` with
``pdserve.loadgen.metrics.summarize`` and prints one Markdown table: goodput (req/s) per rule and
rate, the best rule per rate marked. A prediction, not a measurement: read it with the simulator's
accuracy (``benchmarks/plan_accuracy.py``). Nothing is served; seconds per rate on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random


def main() -> int:
    p = argparse.ArgumentParser(prog="benchmarks/local_prefill_policy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="a pdserve profile JSON")
    p.add_argument("--rates", default="4,8,16,24,32", help="req/s, comma-separated")
    p.add_argument("--busy", default="256,512,1024,2048", help="busy_prefill_tokens values, comma-separated")
    p.add_argument("--num-requests", type=int, default=400)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=400.0)
    p.add_argument("--slo-tpot-ms", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from pdserve.engine.config import EngineConfig
    from pdserve.loadgen.metrics import SLO, summarize
    from pdserve.loadgen.workload import RequestSpec
    from pdserve.planner.host_cpu import ServingPaths
    from pdserve.planner.simulate import SimConfig, Simulator
    from pdserve.planner.step_model import StepModel
    from pdserve.router import local_prefill
    from pdserve.router.local_prefill import LocalPrefill

    with open(args.profile) as f:
        profile = json.load(f)
    model, spec, dtype = StepModel.from_profile(profile), profile["settings"]["model_spec"], profile["machine"]["dtype"]
    serving = ServingPaths.from_profile(profile)
    slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    engine = EngineConfig(model=spec, enable_prefix_caching=False)
    rules = {"prefix": LocalPrefill(32, "prefix")}
    rules.update(
        {f"load-aware {b}": LocalPrefill(32, "load-aware", busy_prefill_tokens=int(b)) for b in args.busy.split(",")}
    )
    rates = [float(r) for r in args.rates.split(",")]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    gaps = [rng.expovariate(1.0) for _ in range(args.num_requests)]
    print(f"profile {args.profile} ({profile['machine'].get('cpu_model', '?')}, {dtype}, {spec}); split 1 + 1; "
          f"{args.num_requests} requests {args.input_len} in / {args.output_len} out; SLO {args.slo_ttft_ms:g} / "
          f"{args.slo_tpot_ms:g} ms; simulated goodput, req/s")  # fmt: skip
    print("| rule | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
    print("|---|" + "---:|" * len(rates))
    table = {}
    for name, rule in rules.items():
        row = []
        for rate in rates:
            t, specs = 0.0, []
            for i, (ids, gap) in enumerate(zip(prompts, gaps)):
                t += gap / rate
                specs.append(RequestSpec(i, t, tuple(ids), args.output_len, "random"))
            cfg = SimConfig(engine, "split", 1, 1, local_prefill_tokens=rule.tokens, local_prefill_policy=rule.policy)
            sim = Simulator(cfg, model, dtype, serving)
            sim.local_prefill = rule  # SimConfig carries the tokens and policy; the thresholds come from here
            row.append(summarize(sim.run(specs), slo)["goodput_rps"])
        table[name] = row
    best = [max(table, key=lambda n: table[n][i]) for i in range(len(rates))]
    for name, row in table.items():
        cells = [f"**{g:.2f}**" if best[i] == name else f"{g:.2f}" for i, g in enumerate(row)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    lp = local_prefill
    print(f"defaults now: busy_prefill_tokens {lp.BUSY_PREFILL_TOKENS}, decode_prefill_tokens "
          f"{lp.DECODE_PREFILL_TOKENS}, min_free_kv {lp.MIN_FREE_KV}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
