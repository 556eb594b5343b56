"""The step-time model and ``--target-itl-ms``: prompt chunks sized to a step-time target from
step times fitted online."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.scheduler import Scheduler
from pdserve.engine.scheduling.step_time import StepTimeModel
from tests.engine.scheduling.test_chunked_prefill import generate_staggered, make_seq, run_step


def fake_seconds(decode_rows: int, prompt_tokens: int) -> float:
    """A machine where a step costs 20 ms + 5 ms per decode row + 2 ms per prompt token."""
    return 0.020 + 0.005 * decode_rows + 0.002 * prompt_tokens


def test_fit_recovers_the_costs_and_answers_the_budget() -> None:
    model = StepTimeModel(min_steps=4)
    rng = random.Random(0)
    assert model.prompt_tokens_within(1.0, 4) == 0  # nothing seen yet: the scheduler's floor applies
    for _ in range(3):
        model.observe(4, 100, fake_seconds(4, 100))
    assert model.coefficients() is None  # too few steps for the fit
    # the proportional model charges the 20 ms per step to the rows: fewer tokens than the truth, 480
    assert 400 < model.prompt_tokens_within(1.0, 4) < 480
    for _ in range(40):
        d, p = rng.randrange(0, 9), rng.choice([0, 0, 16, 64, 256])
        model.observe(d, p, fake_seconds(d, p) * rng.uniform(0.97, 1.03))
    a, c, b = model.coefficients()
    assert a == pytest.approx(0.020, rel=0.15) and c == pytest.approx(0.005, rel=0.15)
    assert b == pytest.approx(0.002, rel=0.05)
    n = model.prompt_tokens_within(0.100, decode_rows=8)  # (100 - 20 - 40) ms / 2 ms
    assert 17 <= n <= 23
    assert model.prompt_tokens_within(0.030, decode_rows=8) == 0  # the decode rows alone take longer


def test_fit_follows_a_change_of_speed() -> None:
    model = StepTimeModel(min_steps=4)
    for i in range(60):
        model.observe(2, 32 * (i % 4), fake_seconds(2, 32 * (i % 4)))
    slow = model.prompt_tokens_within(0.2, 2)
    for i in range(150):  # the same steps now take 4x as long (a slower core, a busier machine)
        model.observe(2, 32 * (i % 4), 4 * fake_seconds(2, 32 * (i % 4)))
    assert model.prompt_tokens_within(0.2, 2) < slow / 3


def test_fit_needs_a_positive_prompt_cost() -> None:
    model = StepTimeModel(min_steps=2)
    for _ in range(10):
        model.observe(3, 0, 0.06)  # decode-only steps say nothing of prompt tokens
    assert model.coefficients() is None
    assert model.prompt_tokens_within(0.2, 3) == 7  # the proportional model: 20 ms a row, 3 decoding
    with pytest.raises(ValueError):
        StepTimeModel(decay=1.0)


def test_scheduler_sizes_chunks_to_the_target() -> None:
    """Beside 3 decoding sequences, a 70 ms target on the fake machine leaves (70-20-15)/2 = 17
    prompt tokens a step; the cap and the one-block floor still hold."""
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=8, max_num_batched_tokens=64, target_step_s=0.070)
    decoders = [make_seq(f"d{i}", 4, max_tokens=200) for i in range(3)]
    for s in decoders:
        sched.add(s)
    run_step(sched)
    sched.add(make_seq("long", 1200, max_tokens=1))
    chunks, seconds = [], []
    while sched.find("long") is not None and len(chunks) < 200:
        b = run_step(sched)
        seconds.append(fake_seconds(b.num_decode_rows, sum(b.num_query_tokens) - b.num_decode_rows))
        sched.observe_step(b, seconds[-1])
        chunks.append(sum(b.num_query_tokens) - b.num_decode_rows)
    assert max(seconds) <= 0.070 + 1e-9  # a cold scheduler errs small, never one huge chunk
    assert all(16 <= c <= 18 for c in chunks[9:-1]), chunks
    assert Scheduler(BlockManager(8, 4), 8, 64, target_step_s=0.070).step_budget() == 4  # nothing measured yet
    assert Scheduler(BlockManager(8, 4), 8, 64).step_budget() == 64  # no target: the fixed budget
    tiny = Scheduler(BlockManager(8, 4), 8, 64, target_step_s=0.001)
    for i in range(10):
        tiny.step_time.observe(0, 16 * i, fake_seconds(0, 16 * i))
    assert tiny.step_budget() == 4  # one block at least, or a prompt would never finish
    with pytest.raises(ValueError):
        Scheduler(BlockManager(8, 4), 8, 64, target_step_s=0.0)


def test_target_itl_keeps_greedy_output(embedded_dir) -> None:
    """With a target small enough to cut every prompt, greedy output equals prefill-first's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (5, 40, 77, 130, 16, 64)]

    def engine(**kw) -> LLMEngine:
        return LLMEngine(
            EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False, **kw)
        )

    reference = generate_staggered(engine(enable_chunked_prefill=False), prompts)
    timed = engine(max_num_batched_tokens=128, target_itl_ms=0.001)
    budgets = []
    original = timed.scheduler.schedule

    def spy():
        budgets.append(timed.scheduler.step_budget())
        return original()

    timed.scheduler.schedule = spy
    assert generate_staggered(timed, prompts) == reference
    assert max(budgets) < 128 and min(budgets) < 32  # the target, not the cap, sized every step
    assert timed.scheduler.step_time.num_steps == len(budgets)
    with pytest.raises(ValueError):
        EngineConfig(model="embedded", target_itl_ms=0)


def test_target_itl_flag_reaches_the_engine_config() -> None:
    import argparse

    from pdserve.worker.flags import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--target-itl-ms", "150"]), device="cpu").target_itl_ms == 150
    assert engine_config_from_args(parser.parse_args([]), device="cpu").target_itl_ms is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--target-itl-ms", "0"])


def test_role_defaults() -> None:
    from pdserve.engine.config import for_role

    base = EngineConfig(model="embedded")
    for role in ("colocated", "prefill", "decode"):  # the token budget only: no step target unless asked
        assert for_role(base, role).target_itl_ms is None and for_role(base, role).max_num_batched_tokens == 2048
    budget = for_role(EngineConfig(model="embedded", max_num_batched_tokens=256), "colocated")
    assert budget.max_num_batched_tokens == 256 and budget.target_itl_ms is None  # a given budget is vLLM's rule
    assert for_role(EngineConfig(model="embedded", target_itl_ms=80.0), "colocated").target_itl_ms == 80.0
    assert for_role(EngineConfig(model="embedded", target_itl_ms=80.0), "prefill").target_itl_ms == 80.0
    unchunked = for_role(EngineConfig(model="embedded", enable_chunked_prefill=False), "colocated")
    assert unchunked.max_num_batched_tokens == 4096 and unchunked.target_itl_ms is None
    sched = LLMEngine(for_role(EngineConfig(model="embedded", num_kv_blocks=64), "colocated")).scheduler
    assert sched.target_step_s is None and sched.max_num_batched_tokens == 2048
    timed = for_role(EngineConfig(model="embedded", num_kv_blocks=64, target_itl_ms=200.0), "colocated")
    assert LLMEngine(timed).scheduler.target_step_s == 0.2


def test_a_cold_colocated_engine_cuts_a_long_first_prompt(embedded_dir) -> None:
    """A prompt that reaches a worker before the fit exists is still cut to the target: with steps
    that take 1 ms a row, a 200 ms target leaves about 200 rows, not the 2048-token cap."""
    from pdserve.engine.config import for_role

    cfg = EngineConfig(model=str(embedded_dir), num_kv_blocks=256, target_itl_ms=200.0)
    engine = LLMEngine(for_role(cfg, "colocated"))
    real = engine.scheduler.observe_step
    engine.scheduler.observe_step = lambda batch, _s: real(batch, 0.001 * sum(batch.num_query_tokens))
    stream = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"d{i}", [5, 6, 7, 8], stream)
    for _ in range(3):
        engine.step()
    long = engine.add_request("long", [9] * 1500, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    chunks = []
    while not long.is_finished:
        before = long.num_computed_tokens
        engine.step()
        chunks.append(long.num_computed_tokens - before)
    assert max(chunks) <= 200 and sum(chunks) == 1500, chunks


def test_the_fixed_cost_stays_in_the_intercept_when_every_step_decodes_alike() -> None:
    """Steps that all decode 8 rows cannot tell a step's cost from a row's; the fit keeps it per
    step, so a step of 32 rows is not predicted at four times the cost (which left no room for
    prompt tokens beside them)."""
    model = StepTimeModel(min_steps=4)
    for i in range(60):
        p = (0, 16, 64, 128)[i % 4]
        model.observe(8, p, fake_seconds(8, p))  # 20 + 40 ms a step, 2 ms a prompt token
    a, c, b = model.coefficients()
    assert a + 8 * c == pytest.approx(0.060, rel=0.01) and b == pytest.approx(0.002, rel=0.01)
    assert a > 0.95 * 0.060
    assert model.prompt_tokens_within(0.200, 32) >= 65  # (200 - 60 - 24 * c) / 2 ms; was 0
