"""Figures comparing placements ("colocated" vs "split") across request rates.

Inputs: ``runs`` maps placement name -> request rate (req/s) -> list of
:class:`~pdserve.loadgen.metrics.RequestRecord`; ``summaries`` has the same keys and holds the output of
:func:`~pdserve.loadgen.metrics.summarize` (or a summary.json read back, in any release's keys:
:func:`~pdserve.loadgen.metrics.read_summary`). Figures are drawn on matplotlib's Agg canvas without pyplot,
so nothing global is touched and nothing is ever shown on screen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pdserve.loadgen.metrics import BREAKDOWN_KEYS, SLO, RequestRecord, read_summary

DPI = 120
_PLACEMENT_COLORS = {"colocated": "tab:blue", "split": "tab:orange"}
_OTHER_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
_BREAKDOWN_LABELS = {"queue": "queue", "prefill": "prefill", "kv_transfer": "KV transfer", "decode": "decode"}
_BREAKDOWN_COLORS = {"queue": "tab:gray", "prefill": "tab:blue", "kv_transfer": "tab:red", "decode": "tab:green"}
_HATCHES = ["", "//", "..", "xx", "\\\\", "oo"]

Runs = Mapping[str, Mapping[float, Sequence[RequestRecord]]]
Summaries = Mapping[str, Mapping[float, dict]]


def _colors(names: Sequence[str]) -> dict[str, str]:
    out, spare = {}, iter(_OTHER_COLORS * 4)
    for name in names:
        out[name] = _PLACEMENT_COLORS.get(name) or next(spare)
    return out


def _rates(table: Mapping[str, Mapping[float, object]]) -> list[float]:
    return sorted({float(r) for per_rate in table.values() for r in per_rate})


def _get(per_rate: Mapping[float, object], rate: float):
    for r, v in per_rate.items():
        if float(r) == rate:
            return v
    return None


def _num(x) -> float:
    """``x`` as a float; nan for None (a summary.json's null) and what is no number."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


def _ms(seconds) -> float:
    return _num(seconds) * 1e3


def _finite(values) -> np.ndarray:
    a = np.asarray([float(v) for v in values], dtype=float)
    return np.sort(a[np.isfinite(a)])


def _save(fig: Figure, out_path) -> Path:
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")


def plot_cdfs(runs: Runs, out_path, slo: SLO | None = None) -> Path:
    """CDFs of TTFT (top row) and TPOT (bottom row) per rate (columns), one line per placement."""
    rates = _rates(runs) or [math.nan]
    colors = _colors(list(runs))
    fig = Figure(figsize=(4.2 * len(rates), 7.0))
    axes = fig.subplots(2, len(rates), squeeze=False)
    metrics = [("ttft_s", "TTFT", slo.ttft_s if slo else None), ("tpot_s", "TPOT", slo.tpot_s if slo else None)]
    for col, rate in enumerate(rates):
        for row, (attr, label, limit) in enumerate(metrics):
            ax = axes[row][col]
            drawn = False
            for name, per_rate in runs.items():
                records = _get(per_rate, rate) or []
                xs = _finite(_ms(getattr(r, attr)) for r in records if r.ok)
                if not xs.size:
                    continue
                ys = np.arange(1, xs.size + 1) / xs.size
                ax.step(xs, ys, where="post", color=colors[name], label=f"{name} (n={xs.size})")
                drawn = True
            if limit is not None:
                ax.axvline(limit * 1e3, color="black", linestyle="--", linewidth=1, label=f"SLO {limit * 1e3:.0f} ms")
            if not drawn:
                _no_data(ax, "no completed requests")
            rate_txt = "no runs" if math.isnan(rate) else f"{rate:g} req/s"
            ax.set_title(f"{label} CDF @ {rate_txt}")
            ax.set_xlabel(f"{label} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_xlim(left=0)
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small", loc="lower right")
    fig.suptitle("Latency distributions by placement and request rate")
    return _save(fig, out_path)


def plot_vs_rate(summaries: Summaries, out_path) -> Path:
    """p90 TTFT (ms), p90 TPOT (ms) and goodput (req/s) against request rate, one line per placement."""
    colors = _colors(list(summaries))
    fig = Figure(figsize=(14.0, 4.2))
    axes = fig.subplots(1, 3, squeeze=False)[0]
    summaries = {name: {r: read_summary(s) for r, s in per_rate.items()} for name, per_rate in summaries.items()}
    has_goodput = any("goodput_rps" in s for per_rate in summaries.values() for s in per_rate.values())
    panels = [
        ("p90 TTFT vs request rate", "p90 TTFT (ms)", lambda s: _ms(s.get("ttft_p90_s"))),
        ("p90 TPOT vs request rate", "p90 TPOT (ms)", lambda s: _ms(s.get("tpot_p90_s"))),
        ("goodput vs request rate", "goodput (req/s)", lambda s: _num(s.get("goodput_rps"))),
    ]
    for ax, (title, ylabel, value) in zip(axes, panels):
        drawn = False
        for name, per_rate in summaries.items():
            points = sorted((float(r), value(s)) for r, s in per_rate.items())
            if not points or not any(math.isfinite(y) for _, y in points):
                continue
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", color=colors[name], label=name)
            drawn = True
        if ylabel.startswith("goodput"):
            rates = _rates(summaries)
            if rates:
                ax.plot(rates, rates, color="gray", linestyle=":", linewidth=1, label="offered rate")
            if not has_goodput:
                _no_data(ax, "no SLO given")
        elif not drawn:
            _no_data(ax)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle("Tail latency and goodput by placement")
    return _save(fig, out_path)


def plot_breakdown(summaries: Summaries, out_path) -> Path:
    """Grouped stacked bars of mean queue / prefill / KV transfer / decode time (ms), per placement and rate."""
    names = list(summaries)
    rates = _rates(summaries)
    fig = Figure(figsize=(max(6.0, 1.6 * max(len(rates), 1) * max(len(names), 1) + 2.0), 4.8))
    ax = fig.subplots()
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        hatch = _HATCHES[i % len(_HATCHES)]
        for j, rate in enumerate(rates):
            x = j + (i - (len(names) - 1) / 2) * width
            summary = read_summary(_get(summaries[name], rate) or {})
            values = [_ms(summary.get(f"{k}_mean_s")) for k in BREAKDOWN_KEYS]
            if not any(math.isfinite(v) for v in values):
                ax.text(x, 0, f"{name}:\nno data", ha="center", va="bottom", fontsize="x-small", color="gray")
                continue
            bottom = 0.0
            for key, v in zip(BREAKDOWN_KEYS, values):
                v = v if math.isfinite(v) else 0.0
                ax.bar(
                    x,
                    v,
                    width * 0.95,
                    bottom=bottom,
                    color=_BREAKDOWN_COLORS[key],
                    hatch=hatch,
                    edgecolor="black",
                    linewidth=0.5,
                )
                bottom += v
    handles = [
        Patch(facecolor=_BREAKDOWN_COLORS[k], edgecolor="black", label=_BREAKDOWN_LABELS[k]) for k in BREAKDOWN_KEYS
    ]  # legend: components by colour, placements by hatch
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch=_HATCHES[i % len(_HATCHES)], label=name)
        for i, name in enumerate(names)
    ]
    if not rates:
        _no_data(ax)
    ax.set_xticks(range(len(rates)), [f"{r:g} req/s" for r in rates])
    ax.set_xlim(-0.6, max(len(rates), 1) - 0.4)
    ax.set_xlabel("request rate (bars left to right: " + ", ".join(names) + ")")
    ax.set_ylabel("mean time per request (ms)")
    ax.set_title("Server-side latency breakdown (mean over completed requests)")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(handles=handles, fontsize="small", ncol=2)
    return _save(fig, out_path)


def write_all(runs: Runs, summaries: Summaries, out_dir, slo: SLO | None = None) -> list[Path]:
    """Write ``cdf.png``, ``vs_rate.png`` and ``breakdown.png`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_cdfs(runs, out / "cdf.png", slo=slo),
        plot_vs_rate(summaries, out / "vs_rate.png"),
        plot_breakdown(summaries, out / "breakdown.png"),
    ]
