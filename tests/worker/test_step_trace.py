"""$PDSERVE_STEP_TRACE: a worker's engine writes each step as the step model takes it (prompt chunks
with their cached prefix, decode rows and their context), and benchmarks/step_trace.py holds the
steps against a step model."""

from __future__ import annotations

import json

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.planner.step_model import StepModel
from pdserve.worker import step_trace
from pdserve.worker.host import EngineHost
from tests.bench._scripts import load_script


def traced_steps(embedded_dir, tmp_path, monkeypatch) -> list[dict]:
    monkeypatch.setenv(step_trace.ENV, str(tmp_path))
    engine = LLMEngine(EngineConfig(model=str(embedded_dir), max_num_batched_tokens=8, dtype="float32"))
    EngineHost(engine)  # attaches the trace, as every worker's host does
    engine.add_request("a", list(range(3, 15)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(3, 6)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.step_trace.file.flush()
    (path,) = tmp_path.glob("steps-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_written_as_the_step_model_takes_it(embedded_dir, tmp_path, monkeypatch):
    steps = traced_steps(embedded_dir, tmp_path, monkeypatch)
    shapes = [(s["chunks"], s["b"], s["context"]) for s in steps]
    # a budget of 8 tokens: a's first 8 tokens; a's last 4 beside b's 3; then both decode, twice
    assert shapes[:2] == [([[8, 0]], 0, 0), ([[4, 8], [3, 0]], 0, 0)]
    assert shapes[2:] == [([], 2, 13 + 4), ([], 2, 14 + 5)]
    for s in steps:
        assert s["t1"] > s["t0"] and s["cpu_ns"] > 0


def test_without_the_variable_nothing_is_traced(embedded_dir, monkeypatch):
    monkeypatch.delenv(step_trace.ENV, raising=False)
    engine = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32"))
    EngineHost(engine)
    assert engine.step_trace is None


def test_the_script_holds_steps_against_the_model(embedded_dir, tmp_path, monkeypatch):
    steps = traced_steps(embedded_dir, tmp_path, monkeypatch)
    one_ms = StepModel(p0=1e-3, p1=0, p2=0, p3=0, d0=1e-3, d1=0, d2=0, m1=0, m2=0, h0=0, h1=1e9)
    rows = {r["kind"]: r for r in load_script("step_trace").rows(steps, one_ms)}
    assert set(rows) == {"prefill", "decode"} and rows["prefill"]["steps"] == 2 and rows["decode"]["steps"] == 2
    wall = sorted((s["t1"] - s["t0"]) / 1e9 for s in steps if not s["chunks"])
    assert rows["decode"]["predicted_ms"] == 1.0
    assert abs(rows["decode"]["ratio_sum"] - sum(wall) / 2e-3) < 1e-9


def test_lines_that_are_no_steps_are_skipped_and_counted(embedded_dir, tmp_path, monkeypatch):
    steps = traced_steps(embedded_dir, tmp_path, monkeypatch)
    (path,) = tmp_path.glob("steps-*.jsonl")
    whole = path.read_text()
    path.write_text(whole + '{"t0": 5, "t1": 1, "cpu_ns": 0, "chunks": [], "b": 1, "context": 2}\n[1]\n' + whole[:40])
    read, bad = load_script("step_trace").read_steps(path)
    assert read == steps and bad == 3  # time running backwards, no step, a line cut short


def test_a_trace_folder_that_cannot_be_written_is_named(embedded_dir, tmp_path, monkeypatch):
    import pytest

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv(step_trace.ENV, str(tmp_path / "afile" / "sub"))
    with pytest.raises(OSError, match="PDSERVE_STEP_TRACE="):
        EngineHost(LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32")))
