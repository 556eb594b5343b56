"""Engine-level behaviour without gRPC: reference equality, preemption, KV hand-off, errors."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.codec import pack_kv, unpack_kv
from pdserve.engine.llm_engine import KvCacheFullError, LLMEngine
from pdserve.engine.params import SamplingParams
from tests.conftest import hf_greedy, mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)  # same length as the pipeline tests: reference reused


@pytest.fixture(scope="module")
def prompts(embedded_dir):
    from pdserve.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(embedded_dir)
    return [tok.encode(p) for p in mixed_prompts()]


def test_batched_greedy_equals_alone_and_reference(embedded_dir, prompts):
    engine = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=512))
    batched = engine.generate(prompts, GREEDY)
    for p, out in zip(prompts, batched):
        assert engine.generate([p], GREEDY)[0] == out
        assert out == hf_greedy(embedded_dir, p, 24)
    assert engine.blocks.num_used == 0


def test_preemption_recomputes_identically(embedded_dir, prompts):
    """A cache too small for every sequence at once forces preemption; tokens must not change."""
    small = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=40, block_size=8))
    params = SamplingParams(temperature=0.0, max_tokens=60)
    picked = prompts[:6]
    need = sum(small.blocks.blocks_for(len(p) + 60) for p in picked)
    assert need > small.blocks.num_blocks, "the cache must be too small to hold every sequence"
    preempted = []
    original = small.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        original(seq)

    small.scheduler._preempt = spy
    outs = small.generate(picked, params)
    assert preempted, "no preemption happened; the test proves nothing"
    big = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=1024, block_size=8))
    assert outs == big.generate(picked, params)
    assert small.blocks.num_used == 0


def test_kv_handoff_between_engines_equals_single_engine(embedded_dir, prompts):
    """Prefill on one engine, pack/unpack the KV, decode on another: the split path in-process."""
    for dtype in ("float32", "bfloat16"):
        prefill = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=256, dtype=dtype))
        decode = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=256, block_size=16, dtype=dtype))
        params = SamplingParams(temperature=0.7, top_k=40, seed=7, max_tokens=12)
        expected = LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=256, dtype=dtype)).generate(
            prompts[:4], params
        )
        for i, p in enumerate(prompts[:4]):
            prefill.add_request(f"r{i}", p, params)
        outs = prefill.step()
        assert prefill.scheduler.running  # still there until extracted
        payloads = [prefill.extract_kv(o.seq) for o in outs]
        assert prefill.blocks.num_used == 0
        seqs = [decode.admit_kv(unpack_kv(pack_kv(pl), decode.fingerprint)) for pl in payloads]
        while decode.has_work():
            decode.step()
        assert [s.output_token_ids for s in seqs] == expected
        assert decode.blocks.num_used == 0


def test_request_checks_and_cache_full(embedded_dir, prompts):
    engine = LLMEngine(
        EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=8, block_size=4, max_model_len=64)
    )
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("b", [10**7], GREEDY)
    with pytest.raises(ValueError, match="context window of 64"):
        engine.add_request("c", [5] * 50, GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("d", [5] * 30, SamplingParams(temperature=0, max_tokens=30))
    donor = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=64, block_size=4))
    donor.add_request("e", [5] * 20, SamplingParams(temperature=0, max_tokens=5))
    payload = donor.extract_kv(donor.step()[0].seq)
    engine.admit_kv(payload)  # takes 6 of 8 blocks
    payload.request_id = "f"
    with pytest.raises(KvCacheFullError):
        engine.admit_kv(payload)
    assert engine.abort("e") is not None and engine.blocks.num_used == 0
    assert engine.abort("e") is None


def test_a_kv_kept_out_by_a_full_cache_preempts_and_every_output_is_unchanged(embedded_dir, prompts):
    """A decode engine whose cache is full of running sequences refuses a KV for now
    (KvCacheFullError: retry); with
    ``preempt`` it admits the KV by preempting the sequence holding the most blocks, which is
    recomputed there later: every greedy output still equals an engine with room (float32)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    donor = LLMEngine(EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=256, block_size=8))
    picked = prompts[:3]
    for i, p in enumerate(picked):
        donor.add_request(f"r{i}", p, params)
    payloads = [donor.extract_kv(o.seq) for o in donor.step()]
    expected = LLMEngine(
        EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=256, block_size=8)
    ).generate(picked, params)
    need = [donor.blocks.blocks_for(len(p) + 40) for p in picked]
    decode = LLMEngine(
        EngineConfig(
            model=str(embedded_dir),
            dtype="float32",
            block_size=8,
            num_kv_blocks=max(need[0] + need[1], need[2] + max(need[:2])),
        )
    )
    seqs = [decode.admit_kv(payloads[0]), decode.admit_kv(payloads[1])]
    while decode.blocks.num_free >= decode.blocks.blocks_for(len(picked[2]) + 1):
        decode.step()
    with pytest.raises(KvCacheFullError):
        decode.admit_kv(payloads[2])
    seqs.append(decode.admit_kv(payloads[2], preempt=True))
    victim = max(seqs[:2], key=lambda s: s.num_preemptions)
    assert victim.num_preemptions == 1 and list(decode.scheduler.waiting) == [victim]
    while decode.has_work():
        decode.step()
    assert [s.output_token_ids for s in seqs] == expected
    assert decode.blocks.num_used == 0


def test_more_threads_than_cpus_is_refused(embedded_dir):
    import os

    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match=rf"{usable + 1} torch threads exceed the {usable} CPUs"):
        LLMEngine(EngineConfig(model=str(embedded_dir), num_kv_blocks=32, torch_threads=usable + 1))
    assert torch.get_num_threads() == before  # refused before anything changed
