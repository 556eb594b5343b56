"""Decode steps on fixed-size inputs (engine/decode_graphs.py): the padded path that CUDA graphs
replay gives the eager path's tokens, its padding rows write only the scratch block, and steps
outside every bucket run eagerly. On CPU the path runs without a graph (``capture=False``); the
captured graphs themselves are checked on a GPU by ``benchmarks/gpu_check.py``."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import decode_graphs
from pdserve.engine.config import EngineConfig
from pdserve.engine.decode_graphs import buckets
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.worker.flags import add_engine_args, engine_config_from_args

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPT_LENS = (3, 17, 40, 9, 64)  # five sequences: the batch-8 bucket pads three rows


def _engine(model, dtype: str, backend: str, padded: bool, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(model), dtype=dtype, attention_backend=backend, num_kv_blocks=96, block_size=4, **kw)
    engine = LLMEngine(cfg)
    assert engine.runner.graphs is None  # CPU: eager unless asked
    if padded:
        engine.runner.start_decode_graphs(engine.max_model_len, capture=False)
    return engine


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("backend", ["cpu-paged", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_decode_gives_the_eager_tokens(embedded_dir, dtype, backend):
    eager = _engine(embedded_dir, dtype, backend, padded=False)
    prompts = _prompts(eager.model_cfg.vocab_size)
    expected = eager.generate(prompts, GREEDY)
    padded = _engine(embedded_dir, dtype, backend, padded=True)
    assert padded.generate(prompts, GREEDY) == expected
    graphs = padded.runner.graphs
    # every decode step but those of a lone last sequence ran padded (5 -> 8, 4 -> 4, ...)
    assert graphs.replays >= GREEDY.max_tokens - 1
    assert padded.blocks.num_used == 0


def test_padding_rows_write_the_scratch_block_and_nothing_else(embedded_dir):
    engine = _engine(embedded_dir, "float32", "cpu-paged", padded=True)
    runner = engine.runner
    cache = runner.kv_cache
    assert cache.shape[2] == runner.num_blocks + 1 == engine.blocks.num_blocks + 1
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts(engine.model_cfg.vocab_size)[:3])]
    engine.step()  # the prefill
    used = sorted({b for s in seqs for b in s.block_table})
    before = cache.clone()
    engine.step()  # one decode step of 3 sequences in the batch-4 bucket: one padding row
    assert runner.graphs.replays == 1
    changed = (cache != before).flatten(4).any(-1).any(0).any(0)  # [num_blocks + 1, block_size]
    touched = {int(b) for b in changed.any(-1).nonzero().flatten()}
    assert runner.num_blocks in touched  # the padding row's K/V
    assert touched - {runner.num_blocks} <= set(used)
    assert changed[runner.num_blocks, 0] and not changed[runner.num_blocks, 1:].any()  # slot 0 only


def test_steps_outside_every_bucket_run_eagerly(embedded_dir, monkeypatch):
    """Contexts longer than MAX_CAPTURE_TOKENS and batches above max_num_seqs' bucket go eager;
    the tokens are the same either way."""
    monkeypatch.setattr(decode_graphs, "MAX_CAPTURE_TOKENS", 32)  # widths up to 8 blocks of 4
    eager = _engine(embedded_dir, "float32", "cpu-paged", padded=False)
    prompts = _prompts(eager.model_cfg.vocab_size)
    short, long = [p for p in prompts if len(p) < 12], [p for p in prompts if len(p) >= 12]
    mixed = _engine(embedded_dir, "float32", "cpu-paged", padded=True)
    graphs = mixed.runner.graphs
    assert graphs.widths == [8] and graphs.bucket_for(1, 9) is None and graphs.bucket_for(65, 1) is None
    assert mixed.generate(short, GREEDY) == eager.generate(short, GREEDY)
    assert graphs.replays == GREEDY.max_tokens - 1  # 9 + 20 positions fit 8 blocks of 4
    assert mixed.generate(long, GREEDY) == eager.generate(long, GREEDY)
    assert graphs.replays == GREEDY.max_tokens - 1  # 17 + 20 positions do not


def test_buckets():
    assert buckets(64, 10) == ([1, 2, 4, 8, 12, 16, 24, 32, 48, 64], [8, 16])
    assert buckets(5, 1) == ([1, 2, 4, 5], [8])
    assert buckets(1000, 100)[0][-3:] == [384, 512, 1000]


def test_enforce_eager_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([]), "cpu").enforce_eager is False
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"]), "cpu").enforce_eager is True
