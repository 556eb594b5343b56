"""pdserve bench against real servers on loopback: trace replay, prefix-cache report, Ctrl-C, refusals."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import pytest

from pdserve.loadgen.dataset_files import dataset_file
from pdserve.loadgen.workload import load_trace, window
from tests.integration._cli import PDSERVE
from tests.integration._pipeline import local_pipeline

RECORD_FIELDS = {
    "index",
    "request_id",
    "scheduled_s",
    "sent_s",
    "prompt_tokens",
    "max_tokens",
    "token_times_s",
    "finish_reason",
    "error",
    "queue_s",
    "prefill_s",
    "kv_transfer_s",
    "decode_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "itl_s",
    "output_tokens",
    "ok",
}
SUMMARY_FIELDS = {
    "requests",
    "completed",
    "failed",
    "duration_s",
    *(f"{m}_{k}_s" for m in ("ttft", "tpot", "itl", "e2e") for k in ("mean", "p50", "p90", "p99", "min", "max")),
    "ttft_count",
    "request_throughput_rps",
    "output_tokens_per_s",
    "total_tokens_per_s",
    *(f"{k}_mean_s" for k in ("queue", "prefill", "kv_transfer", "decode")),
    "slo_ttft_s",
    "slo_tpot_s",
    "slo_attainment",
    "goodput_rps",
    "rate_rps",
}


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_bench_cli_trace_replay(embedded_dir, datasets, tmp_path, placement, monkeypatch):
    from pdserve.rpc.auth import SECRET_ENV

    monkeypatch.delenv(SECRET_ENV, raising=False)  # no admin view, so no per-worker prefix-cache stats
    async with local_pipeline(embedded_dir, placement) as pipe:
        proc = await asyncio.create_subprocess_exec(
            *PDSERVE,
            "bench",
            "--router",
            pipe.address,
            "--tokenizer",
            str(embedded_dir),
            "--num-requests",
            "6",
            "--length-scale",
            "0.05",
            "--slo-ttft-ms",
            "5000",
            "--slo-tpot-ms",
            "1000",
            "--out",
            str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, out.decode()
        assert await pipe.wait_idle() == 0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 6
    rows = window(load_trace("azure-conv"), max_requests=6)
    for rec, row in zip(records, rows):
        assert rec.keys() >= RECORD_FIELDS
        assert rec["ok"] and rec["error"] == ""
        assert rec["output_tokens"] == rec["max_tokens"] == len(rec["token_times_s"])
        assert rec["max_tokens"] == max(1, round(row.output_tokens * 0.05))
        assert rec["prompt_tokens"] == max(1, round(row.input_tokens * 0.05))
        # the trace's own timestamps, unscaled: sent on schedule
        assert rec["scheduled_s"] == pytest.approx(row.t_s, abs=1e-9)
        assert rec["sent_s"] - rec["scheduled_s"] < 0.25
        assert rec["prefill_s"] > 0 and (rec["decode_s"] > 0 or rec["max_tokens"] == 1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_FIELDS
    assert summary["completed"] == 6 and summary["placement"] == placement
    assert "goodput_rps" in out.decode() and "ttft" in out.decode()
    assert summary["prefix_cache"] is None and "prefix cache hit rate: n/a" in out.decode()


async def test_bench_mooncake_reports_prefix_cache_hits_per_worker(embedded_dir, tmp_path, monkeypatch):
    """Mooncake conversation rows all start with hash id 0, so prompts after the first one find that
    block (BOS + 32 tokens: two 16-token KV blocks) cached; the cluster secret lets bench read the workers."""
    from pdserve.rpc.auth import SECRET_ENV

    try:
        dataset_file("mooncake_fast25_traces/conversation_trace.jsonl")
    except FileNotFoundError:
        pytest.skip("../shared/datasets/mooncake_fast25_traces is absent")
    monkeypatch.setenv(SECRET_ENV, "bench-test-secret")  # the workers, the router and bench share it
    async with local_pipeline(embedded_dir, "split") as pipe:
        proc = await asyncio.create_subprocess_exec(
            *PDSERVE,
            "bench",
            "--router",
            pipe.address,
            "--tokenizer",
            str(embedded_dir),
            "--trace",
            "mooncake-conversation",
            "--length-scale",
            "0.0625",
            "--num-requests",
            "8",
            "--rate",
            "2",
            "--max-output-tokens",
            "8",
            "--out",
            str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, out.decode()
        assert await pipe.wait_idle() == 0
        prefill, decode = (w.address for w in pipe.workers)
    report = json.loads((tmp_path / "summary.json").read_text())["prefix_cache"]
    assert {(w["role"], w["address"]) for w in report["workers"]} == {("prefill", prefill), ("decode", decode)}
    prompts = sum(json.loads(line)["prompt_tokens"] for line in (tmp_path / "results.jsonl").read_text().splitlines())
    assert report["query_tokens"] >= prompts  # every prompt admitted on some worker
    assert report["hit_tokens"] >= 32 and report["hit_tokens"] % 16 == 0  # whole KV blocks
    assert 0 < report["hit_rate"] < 1
    text = out.decode()
    for w in report["workers"]:
        rate = f"{w['hit_rate'] * 100:.1f}%" if w["query_tokens"] else "n/a"
        assert w["hit_rate"] == (w["hit_tokens"] / w["query_tokens"] if w["query_tokens"] else None)
        assert f"{w['role']} {w['address']}: {rate}" in text


async def test_bench_ctrl_c_writes_partial_results(embedded_dir, datasets, tmp_path):
    async with local_pipeline(embedded_dir, "split") as pipe:
        proc = await asyncio.create_subprocess_exec(
            *PDSERVE,
            "bench",
            "--router",
            pipe.address,
            "--tokenizer",
            str(embedded_dir),
            "--arrival",
            "poisson",
            "--num-requests",
            "200",
            "--rate",
            "8",
            "--length-scale",
            "10",
            "--max-output-tokens",
            "1900",
            "--max-input-tokens",
            "64",
            "--out",
            str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.startswith(b"sending 200 requests"), line
        await asyncio.sleep(3)  # requests of up to 1,900 tokens sent in the last seconds are in flight
        proc.send_signal(signal.SIGINT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert await pipe.wait_idle() == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert 0 < len(records) < 200, out.decode()
    assert any(r["error"].startswith("cancelled") for r in records)


def test_bench_refuses_remote_address():
    run = subprocess.run(PDSERVE + ["bench", "--router", "192.0.2.1:50051"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "non-loopback" in run.stderr
