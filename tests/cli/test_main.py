"""The pdserve command as a user runs it: serve (colocated, on Ray) + generate, then Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import STORIES

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports() -> tuple[int, int]:
    """Two different free ports (two calls of _free_port may give the same one)."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


def test_help_lists_commands():
    out = subprocess.run(PDSERVE + ["--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "generate", "demo"):
        assert command in out


def test_generate_without_server_fails_clearly():
    port = _free_port()
    run = subprocess.run(
        PDSERVE + ["generate", "hi", "--port", str(port), "--timeout", "5"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    if "DEADLINE_EXCEEDED" not in run.stderr:  # a refused connection: where, and what to do
        assert f"no router answers at 127.0.0.1:{port} (start one with `pdserve serve`" in run.stderr, run.stderr


def _without_secret() -> dict:
    from pdserve.rpc.auth import SECRET_ENV

    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


def test_serve_says_when_it_made_the_cluster_secret(monkeypatch):
    from pdserve.cli.serve import secret_note
    from pdserve.rpc.auth import SECRET_ENV

    monkeypatch.delenv(SECRET_ENV, raising=False)
    note = secret_note()
    assert note.startswith("cluster secret: generated for this run and not shown")
    assert f"export {SECRET_ENV} before serve and for bench" in note and "\n" not in note
    monkeypatch.setenv(SECRET_ENV, "s3cret-value")
    assert secret_note() is None  # the user chose it, so knows it


def _pump(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_serve_generate_and_ctrl_c():
    port, http_port = _free_ports()
    model = ["--model", str(STORIES)] if (STORIES / "model.safetensors").is_file() else []
    serve = subprocess.Popen(
        PDSERVE + ["serve", "--placement", "colocated", "--port", str(port), "--http-port", str(http_port), *model],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_without_secret(), "PYTHONUNBUFFERED": "1"},
    )
    try:
        # a reader thread, so that the deadline holds even while serve prints nothing
        out: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump, args=(serve.stdout, out), daemon=True).start()
        deadline, lines = time.monotonic() + 240, [""]
        while "serving on" not in lines[-1] and serve.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                lines.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
        assert "serving on" in lines[-1], "".join(lines)
        assert f"http://127.0.0.1:{http_port}/v1" in lines[-1]
        assert sum("cluster secret: generated for this run" in line for line in lines) == 1
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as resp:
            assert resp.status == 200
        gen = subprocess.run(
            PDSERVE + ["generate", "Once upon a time", "--port", str(port), "--max-tokens", "40"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        if model:
            assert gen.stdout.startswith(", there was a little girl named Lily.")
        assert "output 40 tokens" in gen.stderr and "TTFT" in gen.stderr
        bad = subprocess.run(
            PDSERVE + ["generate", "", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "prompt is empty" in bad.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            rc = serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            pytest.fail("pdserve serve did not stop within 60 s of Ctrl-C")
    assert rc == 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "hi", "--port", "99999"], "--port: must be in 1..65535, got 99999"),
        (["generate", "hi", "--seed", "-1"], "must be >= 0"),
        (["generate", "hi", "--router", "127.0.0.1:99999"], "port in 1..65535, got '127.0.0.1:99999'"),
        (["bench", "--router", "127.0.0.1"], "expected host:port"),
        (["serve", "--prefill", "0"], "auto may start with no prefill worker"),
        (["serve", "--plan", "plan.json"], "add --placement auto"),
        (["serve", "--slo-tpot-ms", "30"], "--slo-tpot-ms set the targets of --placement auto"),
        (["bench", "--num-requests", "0"], "must be >= 1"),
        (["bench", "--rate", "-1"], "must be a finite number > 0"),
        (["compare", "--rates", "1,0"], "must be a finite number > 0"),
        (["serve", "--model", "/nonexistent/model", "--port", "0"], "not a folder"),
        (["serve", "--no-chunked-prefill", "--target-itl-ms", "50", "--port", "0"], "needs chunked prefill"),
        (["serve", "--address", "127.0.0.1:1", "--port", "0"], "cannot reach a Ray cluster at 127.0.0.1:1"),
        (["compare", "--rates", "abc"], "expected comma-separated numbers > 0, got 'abc'"),
        (["serve", "--port", "50177", "--http-port", "50177"], "the gRPC and HTTP servers need a port each"),
        (["serve", "--host", "203.0.113.7", "--port", "50178"], "Cannot assign requested address; pick --host"),
        (["serve", "--host", "999.1.1.1", "--port", "50179"], "pick --host"),  # not an address at all
        (["throughput", "--max-model-len", "16"], "--input-len 256 + --output-len 64 exceeds the context window of 16"),
        (["generate", "hi", "--bogus"], "usage: pdserve generate"),  # the command's usage, not pdserve's
    ],
)
def test_bad_flags_get_one_clear_line(argv, needle):
    run = subprocess.run(PDSERVE + argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert needle in run.stderr and "Traceback" not in run.stderr


def test_device_cuda_without_gpus_is_refused():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs for both workers")
    run = subprocess.run(
        PDSERVE + ["serve", "--device", "cuda", "--port", "0"], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 2 and "--device cuda needs 2 GPUs" in run.stderr, run.stderr


def test_throughput_prints_and_writes_figures(tmp_path):
    out_json = tmp_path / "w1.json"
    run = subprocess.run(
        PDSERVE
        + [
            "throughput",
            "--model",
            "embedded",
            "--num-prompts",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "5",
            "--dtype",
            "float32",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "tok/s" in run.stdout and "ms/step at batch 3" in run.stdout
    import re

    # the GEMM probes in units that show a small CPU's rate (not "0.00 TFLOP/s")
    probe = re.search(r"matmul ([0-9.e+-]+) GFLOP/s at prefill rows, ([0-9.e+-]+) at 3 rows", run.stdout)
    assert probe and float(probe[1]) > 0 and float(probe[2]) > 0, run.stdout
    import json

    figures = json.loads(out_json.read_text())
    assert figures["dtype"] == "float32" and figures["num_prompts"] == 3
    for key in ("total_tokens_per_s", "prefill_tokens_per_s", "decode_step_ms", "total_bound_s", "memory_gbps"):
        assert figures[key] > 0, key
    # every prompt and output token is counted, over the measured wall time
    assert abs(figures["total_tokens_per_s"] * figures["elapsed_s"] - 3 * 25) < 1e-6


def test_throughput_refuses_a_prompt_over_the_context_window():
    run = subprocess.run(
        PDSERVE
        + ["throughput", "--model", "embedded", "--num-prompts", "1", "--input-len", "5000", "--output-len", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    assert "exceeds the context window" in run.stderr


def test_throughput_reports_the_batch_it_reached_and_refuses_cuda_without_gpus(tmp_path):
    out_json = tmp_path / "w1.json"
    run = subprocess.run(
        PDSERVE
        + [
            "throughput",
            "--model",
            "embedded",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-num-seqs",
            "2",
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "ms/step at batch 2" in run.stdout
    import json

    figures = json.loads(out_json.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert figures["decode_batch"] == 2 and figures["decode_step_ms"] > 0
    import torch

    if not torch.cuda.is_available():
        run = subprocess.run(
            PDSERVE + ["throughput", "--device", "cuda", "--num-prompts", "1", "--input-len", "8", "--output-len", "2"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 2 and "sees no CUDA device" in run.stderr and "Traceback" not in run.stderr


def test_demo_banners_break_only_where_they_mean_to_on_80_columns():
    from io import StringIO

    from rich.console import Console

    from pdserve.cli.demo import EMBEDDED_NOTE, start_banner

    for text in (start_banner("embedded (random weights)", 1), start_banner("smollm2-135m", 2), EMBEDDED_NOTE):
        out = StringIO()
        Console(file=out, width=80, color_system=None).print(f"[dim]{text}[/]")
        assert out.getvalue().splitlines() == text.split("\n")


def test_demo_tables_each_start_on_a_line_of_their_own_in_a_pipe():
    import asyncio
    import io

    from rich.console import Console

    from pdserve.cli.demo import _figures_table, show_answers
    from pdserve.router.client import GenerationResult

    out = io.StringIO()
    console = Console(file=out, width=100)  # not a terminal, as when the demo's output is piped

    async def answer(texts, i):
        await asyncio.sleep(0.01 * (i + 1))
        texts[i] += f"answer {i}"
        return GenerationResult(text=texts[i], token_ids=[1, 2], sent_s=0.0, token_times_s=[0.1, 0.2])

    async def run():
        texts = ["", ""]
        tasks = [asyncio.create_task(answer(texts, i)) for i in range(2)]
        await show_answers(console, ["first prompt", "second prompt"], texts, tasks)
        return [t.result() for t in tasks]

    results = asyncio.run(run())
    console.print(_figures_table(["first prompt", "second prompt"], results))
    lines = out.getvalue().splitlines()
    assert "answer 0" in out.getvalue() and "answer 1" in out.getvalue()
    title = next(line for line in lines if "per request" in line)
    assert title.strip() == "per request"
