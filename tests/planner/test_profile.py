"""``pdserve profile --quick`` on the embedded model: the JSON's sections, keys and units, the fitted
model against its own points, monotone predictions, and mistakes that exit 2 with one line."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import subprocess
import sys

import pytest
import torch

from pdserve.cli.main import main
from pdserve.engine.config import ModelConfig
from pdserve.planner.grid import QUICK
from pdserve.planner.host_cpu import ServingModel, ServingPaths
from pdserve.planner.serving_fit import SERVING_UNITS
from pdserve.planner.step_model import SCHEMA, SECTIONS, UNITS, StepModel

MACHINE_KEYS = {
    "cpu_model", "cpu_count", "torch_threads", "cpu_flags", "torch_version", "device", "gpu", "dtype",
    "attention_backend", "model", "model_fingerprint", "date_utc",
}  # fmt: skip
POINT_KEYS = {
    "prefill": {"prompts", "tokens", "cached_tokens", "seconds", "samples_s"},
    "decode": {"batch", "context", "total_context", "seconds", "samples_s"},
    "mixed": {"prompt_tokens", "cached_tokens", "batch", "total_context", "seconds", "samples_s"},
    "handoff": {"tokens", "bytes", "read_s", "encode_s", "push_s", "seconds", "samples_s"},
}
# No --threads: on CPU the profile runs one torch thread, as a worker of `pdserve serve` does by
# default; on a machine whose cores other work also uses, a second thread would make each op wait
# for the one the OS put to sleep, and the step times swing several times over.
SMALL = ["--device", "cpu", "--dtype", "float32"]


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["profile", *args])
    finally:
        torch.set_num_threads(threads)  # the engine sets it for the whole process
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def profiled(embedded_dir, tmp_path_factory):
    """(stdout, the profile JSON) of one quick run."""
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    rc, out, err = run_cli("--model", str(embedded_dir), *SMALL, "--quick", "--out", str(path))
    assert rc == 0, err
    return out, json.loads(path.read_text())


def test_the_engine_was_measured_pinned_to_one_core_and_the_thread_let_go_after(profiled):
    """One torch thread on one core, as pdserve serve pins a worker: a thread the OS moves between
    cores loses its caches (decode steps measured 1.2x slower unpinned on a 2-core Xeon)."""
    import os

    _, p = profiled
    assert p["settings"]["pinned_cpu"] == min(os.sched_getaffinity(0))
    assert len(os.sched_getaffinity(0)) == os.cpu_count() or len(os.sched_getaffinity(0)) > 1  # restored


def test_the_json_has_every_section_with_its_keys_and_units(profiled, embedded_dir):
    _, p = profiled
    assert set(p) == {"schema", "machine", "settings", "points", "fits", "elapsed_s"} and p["schema"] == SCHEMA
    m = p["machine"]
    assert set(m) == MACHINE_KEYS and set(m["cpu_flags"]) == {"avx2", "avx512f", "amx_bf16"}
    assert (m["device"], m["dtype"], m["torch_threads"], m["model"]) == ("cpu", "float32", 1, embedded_dir.name)
    assert len(m["model_fingerprint"]) == 64 and m["date_utc"].endswith("+00:00")
    assert p["settings"]["repeats"] == QUICK.repeats and p["settings"]["skipped"] == []
    assert p["settings"]["handoff_transport"].startswith("real:")
    for section in SECTIONS:
        assert p["points"][section], section
        for q in p["points"][section]:
            assert set(q) == POINT_KEYS[section], section
            assert len(q["samples_s"]) == QUICK.repeats and q["seconds"] == statistics.median(q["samples_s"])
            assert 0 < q["seconds"] < p["elapsed_s"]  # seconds, not milliseconds
        fit = p["fits"][section]
        assert {k: c["unit"] for k, c in fit["coefficients"].items()} == UNITS[section]
        assert set(fit["error"]) == {"max_rel", "median_rel", "points"}


def test_the_serving_section_times_real_workers_router_and_client_per_placement(profiled):
    _, p = profiled
    points = p["points"]["serving"]
    grid = [(1, 8), (1, 16), (4, 8), (4, 16)]
    for placement in ("colocated", "split"):
        mine = [q for q in points if q["placement"] == placement]
        assert [(q["batch"], q["output_tokens"]) for q in mine] == grid, placement
    for q in points:  # every request streamed all its tokens through the router (else the probe raises)
        assert 0 < q["wall_s"] < p["elapsed_s"] and q["steps"] == q["output_tokens"]
        # the workers' step time, summed: a split pair's steps may overlap, one worker's cannot
        assert 0 < q["engine_s"] < (q["wall_s"] if q["placement"] == "colocated" else 2 * q["wall_s"])
        assert q["router_cpu_s"] > 0 and q["worker_cpu_s"] >= 0
    first = p["points"]["first_token"]
    for placement in ("colocated", "split"):  # the quick probe: 2 prompt lengths, 5 lone requests each
        mine = [q for q in first if q["placement"] == placement]
        assert sorted({q["prompt_tokens"] for q in mine}) == [64, 256] and len(mine) == 10, placement
    for q in first:  # the worker's own prefill is inside the client's TTFT
        assert 0 < q["prefill_s"] < q["ttft_s"] < p["elapsed_s"] and q["queue_s"] >= 0
    long = [q["prefill_s"] for q in first if q["prompt_tokens"] == 256]
    short = [q["prefill_s"] for q in first if q["prompt_tokens"] == 64]
    assert statistics.median(long) > statistics.median(short)  # a real prefill of the prompt it was sent
    for section, placement in (("serving", "colocated"), ("serving_split", "split")):
        fit = p["fits"][section]
        assert fit["placement"] == placement
        assert {k: c["unit"] for k, c in fit["coefficients"].items()} == SERVING_UNITS
        assert all(c["value"] >= 0 for c in fit["coefficients"].values())
        assert fit["coefficients"]["k_prefill"]["value"] > 0  # a prefill step takes some time in a worker
        # the load points: each worker's steps traced while the Poisson load ran, the factors their medians
        roles = {"colocated"} if placement == "colocated" else {"prefill", "decode"}
        assert set(fit["load"]["steps"]) == roles
        prompts, decodes = ("colocated", "colocated") if placement == "colocated" else ("prefill", "decode")
        assert fit["load"]["steps"][prompts]["prompt"]["steps"] >= 5  # 16 requests: a prompt step or more each
        assert fit["load"]["steps"][decodes]["decode"]["steps"] >= 5  # of 16 and 64 output tokens: many decode steps
        for kind, role in (("prompt", prompts), ("decode", decodes)):
            ratio = fit["load"]["steps"][role][kind]
            assert 0 < ratio["p10"] <= ratio["median"] <= ratio["p90"]
            assert fit["coefficients"][f"k_{kind}_load"]["value"] == ratio["median"]
        # the router's process and the load generator worked while each half of the load ran
        assert [(h["requests"], h["output_tokens"]) for h in fit["load"]["halves"]] == [(8, 8 * 16), (8, 8 * 64)]
        assert all(h["router_cores"] > 0 and h["client_cores"] > 0 for h in fit["load"]["halves"])
        assert fit["coefficients"]["cpu_request_load"]["value"] + fit["coefficients"]["cpu_token_load"]["value"] > 0
    paths = ServingPaths.from_profile(p)
    assert paths.colocated == ServingModel.from_profile(p) and paths.split == ServingModel.from_profile(
        p, "serving_split"
    )


def test_the_points_are_the_quick_grid_and_the_cache_really_hit(profiled, embedded_dir):
    _, p = profiled
    pre = p["points"]["prefill"]
    assert [q["tokens"] for q in pre if q["cached_tokens"] == 0 and q["prompts"] == 1] == list(QUICK.prefill_tokens)
    assert {(q["tokens"], q["cached_tokens"]) for q in pre if q["cached_tokens"]} == {(16, 64), (64, 64)}
    assert [(q["prompts"], q["tokens"]) for q in pre if q["prompts"] > 1] == [(4, 16)]  # 4 prompts in one step
    mixed = p["points"]["mixed"]
    assert [(q["prompt_tokens"], q["batch"]) for q in mixed] == [(32, 2), (128, 2)] * 2
    assert [round(q["total_context"] / q["batch"]) for q in mixed] == [34, 34, 130, 130]  # two decode contexts
    assert p["settings"]["mixed_context_tokens"] == list(QUICK.mixed_contexts)
    dec = p["points"]["decode"]
    assert sorted(q["batch"] for q in dec) == [1, 1, 4, 4]
    assert sorted(round(q["context"]) for q in dec) == [34, 34, 130, 130]  # L + its first token + one step
    assert all(q["total_context"] == pytest.approx(q["batch"] * q["context"]) for q in dec)
    mc = ModelConfig.from_folder(embedded_dir)
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4  # float32 K and V
    for q in p["points"]["handoff"]:
        assert q["bytes"] == q["tokens"] * per_token
        for part in ("read_s", "encode_s", "push_s"):  # each run's parts add up to its total
            assert 0 < q[part] <= max(q["samples_s"]), part


def test_the_fit_reproduces_its_points(profiled):
    _, p = profiled
    model = StepModel.from_profile(p)
    pts = p["points"]
    predicted = {
        "prefill": [model.batch_s([(q["tokens"], q["cached_tokens"])] * q["prompts"], 0, 0) for q in pts["prefill"]],
        "decode": [model.decode_s(q["batch"], q["total_context"]) for q in pts["decode"]],
        "mixed": [model.mixed_s(q["prompt_tokens"], 0, q["batch"], q["total_context"]) for q in pts["mixed"]],
        "handoff": [model.handoff_s(q["bytes"]) for q in pts["handoff"]],
    }
    for section, values in predicted.items():
        rel = [abs(v - q["seconds"]) / q["seconds"] for v, q in zip(values, pts[section])]
        assert p["fits"][section]["error"]["max_rel"] == pytest.approx(max(rel)), section
        assert p["fits"][section]["error"]["median_rel"] == pytest.approx(statistics.median(rel)), section
    # On the 2-core machine this was written on, with other work beside it, the quick fits came
    # within 1-6 % of their points at the median (prefill and decode; the mixed check and the
    # hand-off 4-15 %), and single points 20-60 % off where a burst of other work hit them. So the
    # bound tells a wrong fit (the wrong form, a unit off by 1000) from a noisy one, and does not
    # time the machine: half of the points within a factor of 2.
    for section in ("prefill", "decode"):
        assert p["fits"][section]["error"]["median_rel"] < 1.0, section


def test_more_work_is_never_predicted_faster(profiled):
    _, p = profiled
    m = StepModel.from_profile(p)
    assert min(m.p0, m.p1, m.p2, m.p3, m.d0, m.d1, m.d2, m.m1, m.m2, m.h0, m.h1) >= 0
    sizes = [0, 1, 16, 128, 1024, 2048]
    for a, b in zip(sizes, sizes[1:]):
        assert m.prefill_s(a) <= m.prefill_s(b) and m.prefill_s(64, a) <= m.prefill_s(64, b)
        assert m.decode_s(a, 256) <= m.decode_s(b, 256) and m.decode_s(8, a) <= m.decode_s(8, b)
        assert m.mixed_s(a, 0, 4, 512) <= m.mixed_s(b, 0, 4, 512) <= m.mixed_s(b, 0, 8, 1024)
        assert m.batch_s([(16, 0)] * (a + 1), 4, 512) <= m.batch_s([(16, 0)] * (b + 1), 4, 512)
        assert m.handoff_s(a * 2**20) <= m.handoff_s(b * 2**20)


def test_progress_and_the_fits_are_printed(profiled):
    out, _ = profiled
    lines = out.splitlines()
    assert lines[0].startswith("profiling ") and "quick grid" in lines[0]
    last = f" pass {QUICK.passes}/{QUICK.passes}"  # a line per point and pass, its median so far
    for kind in ("prefill  n=", "decode   b=", "mixed    p=", "handoff  n="):
        assert any(line.startswith(kind) and line.endswith(last) for line in lines), kind
    assert lines[-1].startswith("wrote ") and any(line.startswith("decode   d0 ") for line in lines)
    for placement in ("colocated", "split    "):
        assert any(line.startswith(f"serving {placement} batch   4 x  16 tokens") for line in lines)
        assert any(line.startswith(f"serving {placement} first token of   256 prompt tokens") for line in lines)
    assert any(line.startswith("serving  s0 ") for line in lines)
    assert any(line.startswith("serving_split s0 ") for line in lines)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/nonexistent/model"], "error: cannot load model '/nonexistent/model'"),
        (["--out", "/nonexistent/folder/p.json"], "error: --out /nonexistent/folder/p.json: no such folder"),
        (["--out", "/tmp"], "error: --out /tmp: is a folder"),
        (["--out", "/proc/p.json"], "error: --out /proc/p.json: cannot write it here"),
        (["--prefill-tokens", "16,4096"], "error: --prefill-tokens 4096: a prompt step holds"),
        (["--batch-sizes", "1,128"], "error: --batch-sizes 128: a step holds at most --max-num-seqs sequences"),
        (["--context-lens", "64,4096"], "error: --context-lens 4096: a decoding sequence and the"),
        (["--cached-tokens", "100"], "error: --cached-tokens 100: a cached prefix is whole KV blocks"),
        (["--no-prefix-caching"], "error: profile measures cached prefixes: drop --no-prefix-caching"),
        (["--target-itl-ms", "50"], "error: profile measures chunks of set sizes: drop --target-itl-ms"),
    ],
)
def test_mistakes_exit_2_with_one_line(args, needle, embedded_dir, tmp_path):
    rc, _, err = run_cli("--model", str(embedded_dir), *SMALL, "--quick", "--out", str(tmp_path / "p.json"), *args)
    assert rc == 2 and err.startswith(needle) and err.count("\n") == 1, err
    assert not (tmp_path / "p.json").exists()


def test_a_list_flag_that_is_not_numbers_is_a_usage_error():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(["profile", "--batch-sizes", "1,x"])
    assert info.value.code == 2 and "expected comma-separated integers, got '1,x'" in err.getvalue()


def test_help_lists_profile_without_loading_torch():
    code = "import sys; from pdserve.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
    usage = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "--help"], capture_output=True, text=True)
    assert "profile" in usage.stdout
