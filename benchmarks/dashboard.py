"""Render the Grafana dashboard's panels (docs/grafana-dashboard.json) from real scrapes, with matplotlib.

It scrapes a running router's ``/metrics`` every ``--interval`` seconds while ``pdserve bench
--backend openai`` drives that router, then plots each panel with the PromQL of the dashboard
evaluated over the scrapes (``rate`` over ``--window`` seconds, ``histogram_quantile`` with
Prometheus' linear interpolation inside a bucket). Grafana itself is not installable here (it is
in neither Debian's archive nor npm), so this is the stand-in for its screenshot.

    pdserve serve --model embedded:llama-80m &     # HTTP on 127.0.0.1:8000
    python benchmarks/dashboard.py --url http://127.0.0.1:8000 --out docs/dashboard.png -- \\
        --arrival poisson --rate 4 --input-len 256 --output-len 64 --num-requests 120 --prompts random
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Sample = dict  # (name, frozenset(labels)) -> value


def scrape(url: str) -> Sample:
    """One scrape; with $PDSERVE_API_KEY set it goes as the bearer token, as Prometheus sends it."""
    key = os.environ.get("PDSERVE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def series(scrapes: list[tuple[float, Sample]], name: str) -> dict[frozenset, list[tuple[float, float]]]:
    """Every label set of ``name`` as [(t, value)]."""
    out: dict = defaultdict(list)
    for t, sample in scrapes:
        for (n, labels), v in sample.items():
            if n == name:
                out[labels].append((t, v))
    return out


def rate(points: list[tuple[float, float]], window: float) -> list[tuple[float, float]]:
    """PromQL rate(): increase over the last ``window`` seconds, per second."""
    out = []
    for i, (t, v) in enumerate(points):
        j = next(k for k in range(i + 1) if points[k][0] >= t - window)
        if j < i:
            out.append((t, (v - points[j][1]) / (t - points[j][0])))
    return out


def quantile(q: float, scrapes, name: str, window: float) -> list[tuple[float, float]]:
    """PromQL histogram_quantile(q, rate(name_bucket[window])), in the histogram's unit."""
    buckets = series(scrapes, name + "_bucket")
    bounds = sorted(buckets, key=lambda labels: float(dict(labels)["le"]))
    rates = [dict(rate(buckets[b], window)) for b in bounds]
    out = []
    for t in sorted(rates[0]):
        counts = [r.get(t, 0.0) for r in rates]
        total = counts[-1]
        if total <= 0:
            continue
        rank, prev_bound, prev_count = q * total, 0.0, 0.0
        for labels, c in zip(bounds, counts):
            bound = float(dict(labels)["le"])
            if c >= rank:
                if bound == float("inf"):
                    out.append((t, prev_bound))
                else:
                    out.append(
                        (t, prev_bound + (bound - prev_bound) * (rank - prev_count) / max(c - prev_count, 1e-12))
                    )
                break
            prev_bound, prev_count = bound, c
    return out


PANELS = [  # (title, unit, [(label, function of scrapes)])
    ("Request rate by finish reason", "req/s", "requests"),
    ("Time to first token", "ms", "ttft"),
    ("Inter-token latency", "ms", "itl"),
    ("End-to-end latency", "ms", "e2e"),
    ("Phases (p50)", "ms", "phases"),
    ("KV transfer", "MB/s", "kv"),
    ("Requests running / waiting", "sequences", "load"),
    ("KV cache usage", "%", "usage"),
]


def plot(scrapes, out: str, window: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = scrapes[0][0]
    fig, axes = plt.subplots(4, 2, figsize=(14, 13))

    def draw(ax, pts, label, scale=1.0):
        if pts:
            ax.plot([t - t0 for t, _ in pts], [v * scale for _, v in pts], label=label)

    for ax, (panel, unit, key) in zip(axes.flat, PANELS):
        if key == "requests":
            for labels, pts in series(scrapes, "pdserve:requests_total").items():
                draw(ax, rate(pts, window), dict(labels)["finish_reason"])
        elif key in ("ttft", "itl", "e2e"):
            name = {
                "ttft": "pdserve:time_to_first_token_seconds",
                "itl": "pdserve:inter_token_latency_seconds",
                "e2e": "pdserve:e2e_request_latency_seconds",
            }[key]
            for q in (0.5, 0.9, 0.99):
                draw(ax, quantile(q, scrapes, name, window), f"p{round(q * 100)}", 1e3)
        elif key == "phases":
            for phase in ("queue", "prefill", "decode"):
                draw(ax, quantile(0.5, scrapes, f"pdserve:request_{phase}_time_seconds", window), phase, 1e3)
            draw(ax, quantile(0.5, scrapes, "pdserve:kv_transfer_time_seconds", window), "kv transfer", 1e3)
        elif key == "kv":
            for pts in series(scrapes, "pdserve:kv_transfer_bytes_sum").values():
                draw(ax, rate(pts, window), "bytes pushed", 1e-6)
        elif key == "load":
            for metric in ("num_requests_running", "num_requests_waiting"):
                for labels, pts in series(scrapes, f"pdserve:{metric}").items():
                    d = dict(labels)
                    draw(ax, pts, f"{metric.split('_')[-1]} {d['worker']}")  # decode-0: role and index
        else:
            for labels, pts in series(scrapes, "pdserve:kv_cache_usage_perc").items():
                d = dict(labels)
                draw(ax, pts, d["worker"], 100.0)
        ax.set_title(panel)
        ax.set_ylabel(unit)
        ax.set_xlabel("s")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10, wrap=True)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP base URL (loopback)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--window", type=float, default=5.0, help="rate() window, seconds")
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: arguments for pdserve bench")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    scrapes: list[tuple[float, Sample]] = []
    done = threading.Event()

    scrape(args.url)  # fails here, clearly, when nothing serves at --url

    def scraper() -> None:
        while not done.is_set():
            try:
                scrapes.append((time.time(), scrape(args.url)))
            except OSError as exc:  # one missed scrape leaves a gap, not a dead thread
                print(f"scrape failed: {exc}", file=sys.stderr)
            done.wait(args.interval)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    time.sleep(2 * args.interval)  # an idle baseline before the load
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli.main",
        "bench",
        "--backend",
        "openai",
        "--url",
        args.url,
        "--out",
        "bench_results/dashboard",
        *bench_args,
    ]
    rc = subprocess.run(cmd, timeout=1800).returncode
    time.sleep(2 * args.interval)
    done.set()
    thread.join()
    plot(scrapes, args.out, args.window, f"pdserve router {args.url} under pdserve bench {' '.join(bench_args)}")
    print(f"{len(scrapes)} scrapes; wrote {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
