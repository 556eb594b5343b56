"""Chunked prefill: vLLM v1's token-budget rule in the scheduler, and token-identical greedy output
against prefill-first scheduling on a real model (float32)."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.scheduler import Scheduler
from pdserve.engine.scheduling.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence.new(
        rid, list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )


def run_step(sched: Scheduler):
    """Schedule and complete one step; ``batch.sampled`` records which sequences sampled."""
    batch = sched.schedule()
    batch.sampled = [batch.samples(i) for i in range(len(batch.seqs))]
    sched.complete(batch, [7] * sum(batch.sampled))
    return batch


def test_a_prompt_behind_a_long_prefill_gets_half_the_budget() -> None:
    """FIFO, the last prompt cut to the budget; but while a prompt waits, the sequence still
    prefilling leaves it half the budget, so a short prompt is not held behind a long one."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(make_seq("long", 23))
    sched.add(make_seq("short", 3))
    b = run_step(sched)
    assert [s.request_id for s in b.seqs] == ["long"] and b.num_query_tokens == [10]
    assert b.is_prefill and b.sampled == [False]  # a chunk short of the prompt's end samples nothing
    b = run_step(sched)  # long keeps 5 of the 10; short fits the rest and samples its first token
    assert [s.request_id for s in b.seqs] == ["long", "short"] and b.num_query_tokens == [5, 3]
    assert b.sampled == [False, True]
    b = run_step(sched)  # short decodes; long has the rest of the budget for its last 8 tokens
    assert [s.request_id for s in b.seqs] == ["short", "long"] and b.num_query_tokens == [1, 8]
    assert b.sampled == [True, True]
    b = run_step(sched)  # both decode now
    assert b.num_query_tokens == [1, 1] and not b.is_prefill


def test_a_new_prompt_beside_more_decoding_than_max_num_seqs_samples_within_the_bound() -> None:
    """12 sequences decode on a worker that steps 8 at a time; a new 40-token prompt arrives. It is
    admitted at once and gets its first token within ceil(40 / (budget // 2)) + 1 steps, and
    every decoding sequence still gets a token at least every ceil(12 / 7) = 2 steps."""
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=8, max_num_batched_tokens=32)
    longs = [make_seq(f"long{i}", 4, max_tokens=1000) for i in range(12)]
    for s in longs:
        sched.add(s)
    for _ in range(6):
        run_step(sched)
    assert all(s.is_decoding for s in longs) and len(sched.running) == 12
    short = make_seq("short", 40, max_tokens=4)
    sched.add(short)
    last = {s.request_id: s.num_output_tokens for s in longs}
    steps = 0
    while not short.num_output_tokens:
        b = run_step(sched)
        steps += 1
        assert len(b.seqs) <= 8 and sum(b.num_query_tokens) <= 32
    assert steps <= -(-40 // 16) + 1, steps
    for _ in range(10):
        before = {s.request_id: s.num_output_tokens for s in longs}
        run_step(sched)
        run_step(sched)
        assert all(s.num_output_tokens > before[s.request_id] for s in longs)
    assert all(s.num_output_tokens > last[s.request_id] for s in longs)


def test_a_long_prompt_never_holds_decode_back() -> None:
    """Every step of the long prompt's prefill also advances each decoding sequence by one token."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=16)
    decoders = [make_seq(f"d{i}", 4, max_tokens=40) for i in range(3)]
    for s in decoders:
        sched.add(s)
    run_step(sched)
    sched.add(make_seq("long", 200))
    chunks = []
    while not any(s.request_id == "long" and s.num_output_tokens for s in sched.running):
        before = [s.num_output_tokens for s in decoders]
        b = run_step(sched)
        assert [s.num_output_tokens for s in decoders] == [x + 1 for x in before]
        assert sum(b.num_query_tokens) <= 16
        chunks.append(b.num_query_tokens[-1])
    assert chunks == [13] * 15 + [5]  # 16 - 3 decode tokens per step, then what is left of 200


def test_preemption_mid_chunk_recomputes_from_the_start() -> None:
    sched = Scheduler(BlockManager(6, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a, b = make_seq("a", 4, max_tokens=20), make_seq("b", 16)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    for _ in range(30):
        if not sched.has_work():
            break
        run_step(sched)
    assert not sched.has_work() and sched.blocks.num_used == 0
    assert a.num_output_tokens == 20 and b.num_output_tokens == 8


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in (5, 40, 77, 130, 16, 64)]


def generate_staggered(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Half the prompts at once, the rest two steps apart, so prefill chunks and decodes share steps."""
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts[:3])]
    later = list(enumerate(prompts[3:], start=3))
    steps = 0
    while engine.has_work() or later:
        if later and steps % 2 == 0:
            i, p = later.pop(0)
            seqs.append(engine.add_request(f"r{i}", p, GREEDY))
        engine.step()
        steps += 1
    assert engine.blocks.num_used == 0
    return [s.output_token_ids for s in sorted(seqs, key=lambda s: int(s.request_id[1:]))]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_chunked_greedy_equals_prefill_first(embedded_dir, prompts, backend) -> None:
    """Budgets 16 and 32 cut prompts at block boundaries (block_size 16), 37 and 23 off them."""

    def engine(**kw) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(embedded_dir),
                dtype="float32",
                num_kv_blocks=256,
                attention_backend=backend,
                enable_prefix_caching=False,
                **kw,
            )
        )

    reference = generate_staggered(engine(enable_chunked_prefill=False), prompts)
    for budget in (16, 23, 32, 37):
        chunked = engine(max_num_batched_tokens=budget)
        cut = []
        original = chunked.runner.run

        def spy(batch, original=original, cut=cut):
            cut.extend(
                n for s, n in zip(batch.seqs, batch.num_query_tokens) if s.num_computed_tokens + n < s.num_tokens
            )
            return original(batch)

        chunked.runner.run = spy
        assert generate_staggered(chunked, prompts) == reference, f"budget {budget}"
        assert cut, f"budget {budget} cut no prompt; the test proves nothing"
