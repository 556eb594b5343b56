"""Chunked prefill, prefix caching and prefix-aware routing, measured side by side on one machine.

Each variant is a fresh local cluster on the same 2 cores (colocated: 2 ``both`` workers; split:
1 prefill + 1 decode worker; 1 CPU each) serving the same requests, replayed from a trace:

* colocated, chunked prefill (the default budget, and 64 tokens) vs ``--no-chunked-prefill``: p99
  and max ITL, TTFT;
* split, no prefix caching + least-loaded routing (the baseline), prefix caching + least-loaded,
  and prefix caching + prefix-aware routing + conditional disaggregation (the defaults): prefix
  hit rate, TTFT p50/p90/mean, KV bytes moved from prefill to decode (``pdserve:kv_transfer_bytes``
  on the router's /metrics), requests prefilled on the decode worker.

It prints one markdown table per trace and the ratios the README quotes. Loopback only, bounded.

    python benchmarks/scheduling.py --num-requests 200 --rate 1.5 --output-len 64   # the README table
    python benchmarks/scheduling.py --traces mooncake-conversation --num-requests 60 --rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import urllib.request
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.backends import GrpcBackend
from pdserve.bench.args import add_workload_args, build_specs
from pdserve.bench.cli import bench_once
from pdserve.bench.metrics import prefix_cache_report, summarize
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.launch import start_cluster
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.engine.text.tokenizer import Tokenizer

VARIANTS = {  # name -> (placement, engine changes, cluster changes)
    "colocated-chunked": ("colocated", {}, {}),
    "colocated-chunked-64": ("colocated", {"max_num_batched_tokens": 64}, {}),
    "colocated-unchunked": ("colocated", {"enable_chunked_prefill": False}, {}),
    "split-no-cache": ("split", {"enable_prefix_caching": False},
                               {"routing": "least-loaded", "local_prefill_tokens": 0}),
    "split-cache-least-loaded": ("split", {}, {"routing": "least-loaded", "local_prefill_tokens": 0}),
    "split-cache-prefix-aware": ("split", {}, {}),
}
LENGTH_SCALE = {"mooncake-conversation": 0.03125, "azure-conv": 0.25}  # Mooncake: 16-token hash blocks


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
    return {"ttft_p50": s["ttft_s"]["p50"], "ttft_p90": s["ttft_s"]["p90"], "ttft_mean": s["ttft_s"]["mean"],
            "itl_p99": s["itl_s"]["p99"], "itl_max": s["itl_s"]["max"], "failed": s["failed"],
            "hit_rate": (cache or {}).get("hit_rate"),
            "kv_bytes": metrics.get("pdserve:kv_transfer_bytes_sum", 0.0),
            "on_decode": metrics.get("pdserve:requests_prefilled_on_decode_total", 0.0)}


def table(trace: str, rows: dict[str, dict]) -> str:
    head = ("| variant | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | p99 ITL ms | max ITL ms | prefix hit rate "
            "| KV MB moved | prefilled on decode | failed |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, r in rows.items():
        hit = "n/a" if r["hit_rate"] is None else f"{r['hit_rate'] * 100:.0f}%"
        kv = f"{r['kv_bytes'] / 1e6:.1f}" if name.startswith("split") else "-"
        lines.append(f"| {name} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} | {r['ttft_mean'] * 1e3:.0f} "
                     f"| {r['itl_p99'] * 1e3:.0f} | {r['itl_max'] * 1e3:.0f} | {hit} | {kv} | {r['on_decode']:.0f} "
                     f"| {r['failed']} |")
    return f"**{trace}**\n\n" + head + "\n".join(lines)


def ratios(rows: dict[str, dict]) -> list[str]:
    co, c64, nc = rows["colocated-chunked"], rows["colocated-chunked-64"], rows["colocated-unchunked"]
    base, aware = rows["split-cache-least-loaded"], rows["split-cache-prefix-aware"]
    none = rows["split-no-cache"]
    return [f"colocated p99 ITL, chunked / not: {co['itl_p99'] / nc['itl_p99']:.2f}; budget 64: "
            f"{c64['itl_p99'] / nc['itl_p99']:.2f} (target <= 0.33); max ITL: {co['itl_max'] / nc['itl_max']:.2f}, "
            f"{c64['itl_max'] / nc['itl_max']:.2f}",
            f"split mean TTFT, prefix-aware / least-loaded: {aware['ttft_mean'] / base['ttft_mean']:.2f}; "
            f"/ no prefix cache: {aware['ttft_mean'] / none['ttft_mean']:.2f} (target <= 0.6)",
            f"split KV bytes, prefix-aware / least-loaded: {aware['kv_bytes'] / max(base['kv_bytes'], 1):.2f}; "
            f"/ no prefix cache: {aware['kv_bytes'] / max(none['kv_bytes'], 1):.2f} (target <= 0.7)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--traces", default="mooncake-conversation,azure-conv")
    ap.add_argument("--rate", type=float, default=2.0, help="req/s the trace's arrivals are rescaled to")
    ap.add_argument("--model", default="embedded:llama-80m")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    os.environ.setdefault("PDSERVE_CLUSTER_SECRET", secrets.token_hex(16))  # lets bench read workers' stats
    model_dir = resolve_model_dir(args.model)
    tokenizer = Tokenizer.from_folder(model_dir)
    max_len = ModelConfig.from_folder(model_dir).max_position_embeddings
    for trace in args.traces.split(","):
        args.trace, args.length_scale = trace, LENGTH_SCALE.get(trace, args.length_scale)
        args.prompts = args.prompts or "random"
        specs = build_specs(args, tokenizer, max_len, args.rate)
        rows = {}
        for name in args.variants.split(","):
            placement, engine_kw, cluster_kw = VARIANTS[name]
            cfg = ClusterConfig(engine=replace(EngineConfig(model=args.model), **engine_kw), placement=placement,
                                num_prefill=1, num_decode=1, cpus_per_worker=1, router_port=0, http_port=0,
                                **cluster_kw)
            rows[name] = asyncio.run(run_variant(cfg, specs))
            print(f"{trace} / {name}: {rows[name]}", flush=True)
        print(table(trace, rows))
        if len(rows) == len(VARIANTS):
            print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
