"""``pdserve throughput`` on the embedded model at the smallest sizes: the report's figures agree
with each other and with the workload, the JSON matches, and mistakes exit 2 with one error line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import time

import pytest
from safetensors.torch import load_file

from pdserve.cli.main import main
from pdserve.cli.throughput import ThroughputResult, format_result, model_flops_per_token, run_throughput
from pdserve.engine.config import EngineConfig, ModelConfig

PROMPTS, INPUT_LEN, OUTPUT_LEN = 2, 8, 3


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["throughput", *args])
    return rc, out.getvalue(), err.getvalue()


def small(model_dir, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16", *extra]


@pytest.fixture(scope="module")
def report(embedded_dir, tmp_path_factory):
    """(stdout, figures from --json, json path) of one tiny run."""
    path = tmp_path_factory.mktemp("throughput") / "figures.json"
    rc, out, err = run_cli(
        *small(embedded_dir, "--num-prompts", str(PROMPTS), "--input-len", str(INPUT_LEN)),
        *("--output-len", str(OUTPUT_LEN), "--json", str(path)),
    )
    assert rc == 0, err
    return out, json.loads(path.read_text()), path


def test_the_json_holds_every_figure_of_the_workload_that_ran(report, embedded_dir):
    _, r, _ = report
    assert set(r) == {f.name for f in dataclasses.fields(ThroughputResult)}
    assert (r["num_prompts"], r["input_len"], r["output_len"]) == (PROMPTS, INPUT_LEN, OUTPUT_LEN)
    assert (r["model"], r["dtype"]) == (str(embedded_dir), "float32")
    assert r["decode_batch"] == PROMPTS  # all submitted at once, no cap at this size


def test_token_rates_times_their_times_give_the_workload_tokens(report):
    _, r, _ = report
    assert r["total_tokens_per_s"] * r["elapsed_s"] == pytest.approx(PROMPTS * (INPUT_LEN + OUTPUT_LEN))
    assert r["output_tokens_per_s"] * r["elapsed_s"] == pytest.approx(PROMPTS * OUTPUT_LEN)
    assert r["prefill_tokens_per_s"] * r["prefill_s"] == pytest.approx(PROMPTS * INPUT_LEN)
    assert 0 < r["prefill_s"] < r["elapsed_s"]
    assert 0 < r["decode_step_ms"] / 1e3 < r["elapsed_s"]
    # two decode steps: their median is their mean, so prefill plus decode steps fit in the run
    assert r["prefill_s"] + (OUTPUT_LEN - 1) * r["decode_step_ms"] / 1e3 <= r["elapsed_s"]


def test_fractions_are_bound_over_measured(report):
    _, r, _ = report
    assert r["prefill_fraction"] == pytest.approx(r["prefill_bound_s"] / r["prefill_s"])
    assert r["decode_fraction"] == pytest.approx(r["decode_step_bound_ms"] / r["decode_step_ms"])
    assert r["total_fraction"] == pytest.approx(r["total_bound_s"] / r["elapsed_s"])
    # each is positive and finite; how close to 1 depends on what else the machine runs (a figure
    # past its bound is flagged in the report, test_a_figure_past_its_bound_adds_a_warning)
    for name in ("prefill_fraction", "decode_fraction", "total_fraction"):
        assert 0 < r[name] < float("inf"), name
    # the whole run's bound: the prefill, then output_len - 1 decode steps of the batch
    steps = (OUTPUT_LEN - 1) * PROMPTS / r["decode_batch"]
    assert r["total_bound_s"] == pytest.approx(r["prefill_bound_s"] + steps * r["decode_step_bound_ms"] / 1e3)


def test_bounds_follow_the_model_and_the_probes(report, embedded_dir):
    _, r, _ = report
    mc = ModelConfig.from_folder(embedded_dir)
    # FLOPs per token are twice the weights a token multiplies: every matrix but the embedding
    weights = load_file(embedded_dir / "model.safetensors")
    matrices = [w.numel() for name, w in weights.items() if w.dim() == 2 and name != "model.embed_tokens.weight"]
    assert model_flops_per_token(mc) == 2 * sum(matrices)
    assert r["matmul_tflops"] > 0 and r["matmul_tflops_decode"] > 0 and r["memory_gbps"] > 0
    attention = 2 * mc.num_layers * mc.num_heads * mc.head_dim * INPUT_LEN**2
    head = 2 * mc.hidden_size * mc.vocab_size  # lm_head: each prompt's last position only
    flops = PROMPTS * (INPUT_LEN * (model_flops_per_token(mc) - head) + head + attention)
    assert r["prefill_bound_s"] == pytest.approx(flops / (r["matmul_tflops"] * 1e12))
    # a decode step reads every weight matrix and the KV cache once, or computes, whichever is longer
    kv_bytes = PROMPTS * (INPUT_LEN + OUTPUT_LEN / 2) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    read_s = (model_flops_per_token(mc) // 2 * 4 + kv_bytes) / (r["memory_gbps"] * 1e9)
    compute_s = PROMPTS * model_flops_per_token(mc) / (r["matmul_tflops_decode"] * 1e12)
    assert r["decode_step_bound_ms"] == pytest.approx(max(read_s, compute_s) * 1e3)


def test_the_printed_report_shows_the_figures(report):
    out, r, path = report
    assert f"{PROMPTS} prompts x {INPUT_LEN} random tokens in -> {OUTPUT_LEN} greedy tokens out, EOS ignored" in out
    assert f"dtype float32 ({r['dtype_reason']})" in out
    assert f"{r['total_fraction']:.0%} of it)" in out
    assert f"at batch {PROMPTS}" in out and f"{r['decode_fraction']:.0%})" in out
    assert f"{r['total_tokens_per_s']:9.0f} tok/s" in out
    assert out.rstrip().endswith(f"wrote {path}")
    past_bound = max(r["prefill_fraction"], r["decode_fraction"], r["total_fraction"]) > 1
    assert ("warning: past its bound" in out) is past_bound


def test_a_figure_past_its_bound_adds_a_warning(report):
    _, r, _ = report
    result = ThroughputResult(**r)
    within = dataclasses.replace(result, prefill_fraction=0.5, decode_fraction=0.5, total_fraction=0.5)
    assert "warning" not in format_result(within)
    for name in ("prefill_fraction", "decode_fraction", "total_fraction"):  # the run's own may be past it too
        text = format_result(dataclasses.replace(within, **{name: 1.2}))
        assert text.splitlines()[-1].startswith(f"warning: past its bound ({name.split('_')[0]}): the probes"), name
    quantized = format_result(dataclasses.replace(within, quantization="int4", prefill_fraction=1.2))
    assert quantized.splitlines()[-1].startswith("warning: past its bound (prefill): the bound's compute part")


def test_max_num_seqs_caps_the_decode_batch(embedded_dir):
    cfg = EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=1, device="cpu")
    r = run_throughput(cfg, num_prompts=2, input_len=4, output_len=2)
    assert r.decode_batch == 1
    assert r.output_tokens_per_s * r.elapsed_s == pytest.approx(4)
    steps = (2 - 1) * 2 / 1
    assert r.total_bound_s == pytest.approx(r.prefill_bound_s + steps * r.decode_step_bound_ms / 1e3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--output-len", "1"), "error: --output-len must be >= 2"),
        (("--input-len", "5000", "--output-len", "2"), "exceeds the context window"),
        (("--json", "/no/such/folder/figures.json"), "error: --json /no/such/folder/figures.json: no such folder"),
    ],
)
def test_mistakes_exit_2_with_one_error_line(embedded_dir, flags, message):
    rc, out, err = run_cli(*small(embedded_dir, "--num-prompts", "1", "--input-len", "4"), *flags)
    assert rc == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--num-prompts", "--input-len", "--output-len"])
def test_sizes_below_one_are_refused_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["throughput", flag, "0"])
    assert info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_every_step_that_computes_prompt_tokens_counts_as_prefill(embedded_dir, monkeypatch):
    """With a small token budget the prompts are prefilled over several steps, most of them beside
    decode rows of earlier prompts (chunked prefill); each such step belongs to the prefill time."""
    from pdserve.engine.model_runner import ModelRunner

    run, prefill_steps = ModelRunner.run, []

    def slow_prefill(self, batch):
        if any(not s.is_decoding and s.request_id.startswith("throughput-") for s in batch.seqs):  # not the warm-up
            prefill_steps.append(batch)
            time.sleep(0.05)
        return run(self, batch)

    monkeypatch.setattr(ModelRunner, "run", slow_prefill)
    cfg = EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    r = run_throughput(cfg, num_prompts=4, input_len=24, output_len=4)
    assert len(prefill_steps) >= 4 and r.prefill_s >= 0.05 * len(prefill_steps)


def test_a_quantized_run_names_its_quantization_and_reads_fewer_weight_bytes(embedded_dir):
    from pdserve.cli.throughput import weight_bytes
    from pdserve.engine.config import ModelConfig

    mc = ModelConfig.from_folder(embedded_dir)
    head = mc.hidden_size * mc.vocab_size * 2
    bf16, int8, int4 = (weight_bytes(mc, 2, q) for q in ("none", "int8", "int4"))
    assert (bf16 - head) == pytest.approx(2 * (int8 - head), rel=1e-6)  # the layers' weights at 1 byte, not 2
    assert (int8 - head) == pytest.approx((int4 - head) / 0.625, rel=1e-6)
    assert weight_bytes(mc, 4) == 2 * bf16  # float32, nothing quantized


def test_the_report_names_a_quantization_when_there_is_one(report):
    out, r, _ = report
    assert r["quantization"] == "none" and "quantization" not in out
    result = ThroughputResult(**r)
    assert "quantization int4" in format_result(dataclasses.replace(result, quantization="int4"))
