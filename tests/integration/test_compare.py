"""pdserve compare end to end: both placements at several rates, and a fresh install with no datasets
and a peer server."""

from __future__ import annotations

import asyncio
import json
import subprocess

from tests.integration._cli import PDSERVE
from tests.integration._pipeline import local_pipeline


def test_compare_end_to_end(datasets, tmp_path):
    """Both placements on a local Ray instance, two rates, table + plots + JSON."""
    run = subprocess.run(
        PDSERVE + ["compare", "--model", "embedded", "--rates", "4,8", "--num-requests", "5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("cdf.png", "vs_rate.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "compare.json").read_text())
    assert set(data["summaries"]) == {"colocated", "split"}
    for per_rate in data["summaries"].values():
        assert set(per_rate) == {"4", "8"}
        for s in per_rate.values():
            assert s["completed"] == 5 and s["goodput_rps"] is not None and s["rate_rps"] in (4, 8)
    assert "unloaded single-request" in data["slo"]["note"]
    table = (tmp_path / "table.md").read_text()
    assert table.count("| colocated |") == 2 and table.count("| split |") == 2


async def test_compare_from_an_empty_folder_without_datasets_and_a_peer(tmp_path, embedded_dir):
    """A fresh install run anywhere: no datasets folder, so a synthetic workload; a running
    OpenAI-compatible server (here pdserve's own HTTP API) as the third row."""
    import os

    env = {**os.environ, "PDSERVE_DATASETS": str(tmp_path / "no-datasets-here")}
    async with local_pipeline(embedded_dir, "split", http=True) as peer:
        cmd = PDSERVE + [
            "compare",
            "--model",
            "embedded",
            "--placements",
            "colocated",
            "--rates",
            "4",
            "--num-requests",
            "4",
            "--input-len",
            "24",
            "--output-len",
            "6",
            "--peer-url",
            peer.http_url,
            "--out",
            str(tmp_path / "out"),
        ]
        run = await asyncio.to_thread(
            subprocess.run, cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no datasets folder found" in run.stdout and "synthetic workload" in run.stdout
    data = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert set(data["summaries"]) == {"colocated", "peer"}
    for per_rate in data["summaries"].values():
        assert per_rate["4"]["completed"] == 4
    assert "| peer |" in (tmp_path / "out" / "table.md").read_text()
