"""build_workload ties arrivals, lengths and prompts into request specs; the workload module stays light."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.loadgen.workload import (
    RequestSpec,
    build_workload,
    clip_lengths,
    gamma_arrivals,
    sample_rows,
    scale_to_rate,
    window,
)

DATASET = "azure_llm_trace_2023"  # the datasets_dir fixture (conftest.py) skips when it is absent


@pytest.fixture(scope="module")
def pool(datasets_dir, embedded_dir):
    from pdserve.engine.text.tokenizer import Tokenizer
    from pdserve.loadgen.prompt_datasets import load_prompts
    from pdserve.loadgen.prompts import PromptPool

    return PromptPool(load_prompts(["sharegpt", "belle-zh"], datasets_dir), Tokenizer.from_folder(embedded_dir), 0)


def test_build_workload_ties_schedule_lengths_and_prompts(conv, pool):
    rows = scale_to_rate(window(conv, start_s=300.0, max_requests=40), 8.0)
    arrivals = [r.t_s for r in rows]
    lengths = [clip_lengths(r.input_tokens, r.output_tokens, 2048, length_scale=0.5) for r in rows]
    specs = build_workload(arrivals, lengths, pool, seed=11)
    assert len(specs) == 40
    for i, (spec, t, (inp, out)) in enumerate(zip(specs, arrivals, lengths)):
        assert isinstance(spec, RequestSpec) and spec.index == i
        assert spec.send_at_s == t
        assert len(spec.prompt_token_ids) == inp and spec.max_tokens == out
        assert spec.prompt_token_ids[0] == pool.tokenizer.bos_token_id
        assert spec.prompt_source in ("sharegpt", "belle-zh")
    assert {s.prompt_source for s in specs} == {"sharegpt", "belle-zh"}
    assert build_workload(arrivals, lengths, pool, seed=11) == specs
    assert build_workload(arrivals, lengths, pool, seed=12) != specs


def test_build_workload_with_synthetic_arrivals(conv, pool):
    arrivals = gamma_arrivals(5.0, 30, 0.5, seed=2)
    lengths = [clip_lengths(r.input_tokens, r.output_tokens, 1024) for r in sample_rows(conv, 30, seed=2)]
    specs = build_workload(arrivals, lengths, pool, seed=0)
    assert [s.send_at_s for s in specs] == arrivals
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in specs] == lengths


def test_build_workload_rejects(pool):
    with pytest.raises(ValueError, match="2 arrivals but 1 lengths"):
        build_workload([0.0, 1.0], [(3, 3)], pool, seed=0)
    with pytest.raises(ValueError):
        build_workload([0.0, 1.0], [(3, 3), (0, 3)], pool, seed=0)
    with pytest.raises(ValueError):
        build_workload([1.0, 0.5], [(3, 3), (3, 3)], pool, seed=0)


def test_workload_module_imports_neither_torch_nor_ray():
    import subprocess

    code = (
        "import sys, pdserve.loadgen.workload, pdserve.loadgen.prompts; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
