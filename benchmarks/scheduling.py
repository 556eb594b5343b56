"""Chunked prefill, prefix caching and prefix-aware routing, measured side by side on one machine.

Each variant is a fresh local cluster on the same 2 cores (colocated: 2 ``colocated`` workers; split:
1 prefill + 1 decode worker, 1 CPU each, or 2 + 2 sharing them) serving the same requests,
replayed from a trace (Mooncake: a 1/16 hashed sample of its conversations, ``--conversation-sample``):

* colocated, chunked prefill (the default 2,048-token budget; a fixed 256-token budget; chunks
  sized to 200 ms steps) vs ``--no-chunked-prefill``: p99 and max ITL, TTFT;
* split, no prefix caching + least-loaded routing (the baseline), prefix
  caching + least-loaded, and prefix caching + prefix-aware routing + conditional disaggregation
  (the defaults), each with 1 + 1 and 2 + 2 workers: prefix hit rate, TTFT p50/p90/mean, KV bytes
  moved from prefill to decode (``pdserve:kv_transfer_bytes`` on the router's /metrics), requests
  prefilled on the decode worker.

It prints one markdown table per trace and the ratios docs/measurements.md quotes. Loopback only, bounded.

    python benchmarks/scheduling.py --traces mooncake-conversation --num-requests 80 --rate 0.25 --output-len 64
    python benchmarks/scheduling.py --traces azure-conv --num-requests 80 --rate 1.0 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import urllib.request
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.bench import bench_once
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.launch import start_cluster
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.loadgen.args import add_workload_args, build_specs
from pdserve.loadgen.metrics import prefix_reuse_ceiling, summarize
from pdserve.loadgen.prefix_cache import prefix_cache_report
from pdserve.loadgen.targets import GrpcBackend

VARIANTS = {  # name -> (placement, engine changes, cluster changes)
    "colocated-chunked": ("colocated", {}, {}),  # the default: a 2,048-token budget
    "colocated-chunked-256": ("colocated", {"max_num_batched_tokens": 256}, {}),  # a fixed budget
    "colocated-target-200": ("colocated", {"target_itl_ms": 200.0}, {}),  # chunks sized to 200 ms steps
    "colocated-unchunked": ("colocated", {"enable_chunked_prefill": False}, {}),
    "split-no-cache": (
        "split",
        {"enable_prefix_caching": False},
        {"routing": "least-loaded", "local_prefill_tokens": 0},
    ),
    "split-cache-least-loaded": ("split", {}, {"routing": "least-loaded", "local_prefill_tokens": 0}),
    "split-cache-prefix-aware": ("split", {}, {}),
    # 2 prefill + 2 decode workers sharing the 2 cores: routing has a choice to make
    "split-2x2-no-cache": (
        "split",
        {"enable_prefix_caching": False},
        {"routing": "least-loaded", "local_prefill_tokens": 0, "num_prefill": 2, "num_decode": 2},
    ),
    "split-2x2-cache-least-loaded": (
        "split",
        {},
        {"routing": "least-loaded", "local_prefill_tokens": 0, "num_prefill": 2, "num_decode": 2},
    ),
    "split-2x2-cache-prefix-aware": ("split", {}, {"num_prefill": 2, "num_decode": 2}),
}
LENGTH_SCALE = {"mooncake-conversation": 0.03125, "azure-conv": 0.25}  # Mooncake: 16-token hash blocks
# A 1/16 hashed sample of Mooncake conversations: its first 200 requests could reuse 33% of their
# prompt blocks (the whole hour: 37%); the first 200 rows of the trace, mostly first turns, only 6%.
CONVERSATION_SAMPLE = {"mooncake-conversation": 0.0625}


def scrape(http_address: str) -> dict[str, float]:
    """Sample values of the router's /metrics by sample name."""
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


async def run_variant(cfg: ClusterConfig, specs) -> dict:
    with start_cluster(cfg) as cluster:
        async with GrpcBackend(cluster.address) as backend:
            before = await backend.prefix_counters()
            records, _ = await bench_once(backend, specs, "sched", max_duration_s=600, progress=False)
            cache = prefix_cache_report(before, await backend.prefix_counters())
        metrics = scrape(cluster.http_address)
    s = summarize(records)
    return {
        **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "itl_p99_s", "itl_max_s", "failed")},
        "prefix_hit_rate": (cache or {}).get("hit_rate"),
        "kv_transfer_bytes": metrics.get("pdserve:kv_transfer_bytes_sum", 0.0),
        "prefilled_on_decode": metrics.get("pdserve:requests_prefilled_on_decode_total", 0.0),
    }


def table(trace: str, rows: dict[str, dict]) -> str:
    head = (
        "| variant | ttft_p50_ms | ttft_p90_ms | ttft_mean_ms | itl_p99_ms | itl_max_ms | prefix_hit_rate "
        "| kv_transfer_mb | prefilled_on_decode | failed |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for name, r in rows.items():
        hit = "n/a" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate'] * 100:.0f}%"
        kv = f"{r['kv_transfer_bytes'] / 1e6:.1f}" if name.startswith("split") else "-"
        ms = [f"{r[k] * 1e3:.0f}" for k in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "itl_p99_s", "itl_max_s")]
        lines.append(f"| {name} | {' | '.join(ms)} | {hit} | {kv} | {r['prefilled_on_decode']:.0f} | {r['failed']} |")
    return f"**{trace}**\n\n" + head + "\n".join(lines)


def ratios(rows: dict[str, dict]) -> list[str]:
    """The ratios the issue's targets name, for the variants that ran."""

    def ratio(key: str, num: str, den: str) -> str | None:
        if num not in rows or den not in rows:
            return None
        return f"{rows[num][key] / max(rows[den][key], 1e-9):.2f}"

    out = []
    for chunked in ("colocated-chunked", "colocated-chunked-256", "colocated-target-200"):
        r = ratio("itl_p99_s", chunked, "colocated-unchunked")
        if r:
            out.append(
                f"itl_p99, {chunked} / colocated-unchunked: {r} (target <= 0.33); itl_max: "
                f"{ratio('itl_max_s', chunked, 'colocated-unchunked')}; ttft_mean: "
                f"{ratio('ttft_mean_s', chunked, 'colocated-unchunked')}"
            )
    for aware, bases in (
        ("split-cache-prefix-aware", ("split-cache-least-loaded", "split-no-cache")),
        ("split-2x2-cache-prefix-aware", ("split-2x2-cache-least-loaded", "split-2x2-no-cache")),
    ):
        for base in bases:
            t, kv = ratio("ttft_mean_s", aware, base), ratio("kv_transfer_bytes", aware, base)
            if t:
                out.append(f"{aware} / {base}: ttft_mean {t} (target <= 0.6), kv_transfer_bytes {kv} (target <= 0.7)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--traces", default="mooncake-conversation,azure-conv")
    ap.add_argument("--rate", type=float, default=2.0, help="req/s the trace's arrivals are rescaled to")
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    sample = args.conversation_sample
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_hex(16))  # lets bench read workers' stats
    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_folder(model_dir)
    max_len = ModelConfig.from_folder(model_dir).max_position_embeddings
    for trace in args.traces.split(","):
        args.trace, args.length_scale = trace, LENGTH_SCALE.get(trace, args.length_scale)
        args.conversation_sample = (sample or CONVERSATION_SAMPLE.get(trace)) if trace.startswith("mooncake") else None
        args.prompts = args.prompts or "random"
        specs = build_specs(args, tokenizer, max_len, args.rate)
        mean_prompt = sum(len(s.prompt_token_ids) for s in specs) / len(specs)
        print(
            f"{trace}: {len(specs)} requests, mean prompt {mean_prompt:.0f} "
            f"tokens, reuse ceiling {prefix_reuse_ceiling([s.prompt_token_ids for s in specs]) * 100:.0f}% "
            f"(conversation sample {args.conversation_sample})",
            flush=True,
        )
        rows = {}
        for name in args.variants.split(","):
            placement, engine_kw, cluster_kw = VARIANTS[name]
            cluster_kw = {"num_prefill": 1, "num_decode": 1, **cluster_kw}
            cfg = ClusterConfig(
                engine=replace(EngineConfig(model=args.model), **engine_kw),
                placement=placement,
                cpus_per_worker=1,
                router_port=0,
                http_port=0,
                **cluster_kw,
            )
            rows[name] = asyncio.run(run_variant(cfg, specs))
            print(f"{trace} / {name}: {rows[name]}", flush=True)
        print(table(trace, rows))
        print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
