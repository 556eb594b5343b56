"""A hybrid model (tiny Gemma 3: layers sliding, global, sliding; window 16) keeps one block table per
KV cache group: the sliding-window layers free the blocks behind their window on both sides of a
hand-off while the global layer keeps every block, and greedy output still equals transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._gemma_cases import build_gemma
from tests.engine.models._layout_cases import NEEDS_TOKENIZER, _assert_same_tokens
from tests.engine.models._tiny_models import BASE, hf_greedy, load_hf, prefill_payloads

pytestmark = NEEDS_TOKENIZER
pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.kv.codec import pack_kv, unpack_kv  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402
from pdserve.engine.scheduling.block_manager import NULL_BLOCK  # noqa: E402

WINDOW, BS, MAX_TOKENS, BUDGET = 16, 4, 24, 32
PROMPT_LENS = (5, 30, 97, 150)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
WINDOW_BLOCKS = -(-(WINDOW + BUDGET) // BS) + 1  # the most a window group holds while chunks run


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    folder = build_gemma(tmp_path_factory.mktemp("gemma3-hybrid"), "gemma3")
    gen = torch.Generator().manual_seed(78)
    prompts = [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    eos = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=8)).eos_token_ids
    return folder, prompts, hf_greedy(load_hf(folder), prompts, MAX_TOKENS, eos)


def _engine(folder, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=200, block_size=BS, **kw)
    return LLMEngine(cfg)


def _window_held(seq) -> list[int]:
    return [len(t) - t.count(NULL_BLOCK) for t in seq.block_tables[1:]]


def test_the_window_layers_hold_only_their_window(hybrid_model):
    folder, prompts, ref = hybrid_model
    engine = _engine(folder, max_num_batched_tokens=BUDGET)
    groups = engine.runner.kv_groups
    assert groups.windows == (None, WINDOW, WINDOW) and groups.layers == ((1,), (0,), (2,))
    assert engine.runner.num_blocks == 600  # 200 blocks of all 3 layers are 600 blocks of one layer
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    peak = 0
    while engine.has_work():
        engine.step()
        for s in seqs:
            if s.is_finished:
                continue
            full = s.block_tables[0]
            assert NULL_BLOCK not in full and len(full) * BS >= s.num_computed_tokens
            peak = max([peak, *_window_held(s)])
    _assert_same_tokens([s.output_token_ids for s in seqs], ref)
    assert 0 < peak <= WINDOW_BLOCKS
    assert engine.blocks.num_used == 0 and engine.blocks.num_window_freed > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_whole_hand_off_places_every_group_and_decode_frees_as_it_goes(hybrid_model, prefix_caching):
    folder, prompts, ref = hybrid_model
    kw = dict(enable_prefix_caching=prefix_caching)
    prefill, decode = _engine(folder, **kw), _engine(folder, **kw)
    payloads = prefill_payloads(prefill, prompts, GREEDY)
    seqs = []
    for pl in payloads:
        n = len(pl.token_ids)
        assert pl.kv_start == 0 and pl.kv.shape[:3] == (3, 2, n)  # the global layer needs every position
        behind = max(0, n - WINDOW + 1) // BS * BS  # the window layers' positions freed before the hand-off
        assert not pl.kv[[0, 2], :, :behind].any() and pl.kv[1, :, :behind].abs().sum() > 0 or behind == 0
        seq = decode.admit_kv(unpack_kv(pack_kv(pl), decode.fingerprint))
        assert all(held <= WINDOW // BS + 2 for held in _window_held(seq))
        seqs.append(seq)
    while decode.has_work():
        decode.step()
        assert all(held <= WINDOW // BS + 2 for s in seqs if not s.is_finished for held in _window_held(s))
    order = {s.request_id: s.output_token_ids for s in seqs}
    _assert_same_tokens([order[f"r{i}"] for i in range(len(prompts))], ref)
    assert decode.blocks.num_used == 0


def test_a_reservation_takes_no_block_behind_the_window(hybrid_model):
    """``reserve_kv`` gives the window layers blocks only from their window on: their frames
    (``layer_frames.frame_start``) bring nothing before it."""
    folder, prompts, _ = hybrid_model
    prefill, decode = _engine(folder), _engine(folder)
    prefill.add_request("r", prompts[-1], GREEDY)
    payload = next(prefill.extract_kv(o.seq) for o in prefill.step() if o.prefill)
    n = len(payload.token_ids)  # 150: the first decode query reads 135..150, from block 33 on
    seq = decode.reserve_kv(payload)
    assert len(seq.block_tables[0]) == 38 and NULL_BLOCK not in seq.block_tables[0]
    for table in seq.block_tables[1:]:
        assert table[:33] == [NULL_BLOCK] * 33 and NULL_BLOCK not in table[33:] and len(table) == 38
    assert decode.blocks.num_used == 38 + 2 * 5 and decode.blocks.group_window_start(1, n) == 132
    decode.release_kv(seq)
    assert decode.blocks.num_used == 0
