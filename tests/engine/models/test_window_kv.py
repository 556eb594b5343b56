"""A model whose every layer has a sliding window (Mistral, window 16): the engine frees the blocks
that fell out of the window on both sides of a hand-off, the KV payload carries only the window's
blocks, and greedy output still equals transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._layout_cases import NEEDS_TOKENIZER, _assert_same_tokens
from tests.engine.models._tiny_models import BASE, build_model, hf_greedy, load_hf, prefill_payloads

pytestmark = NEEDS_TOKENIZER
pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.kv.codec import pack_kv, unpack_kv  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402
from pdserve.engine.scheduling.block_manager import NULL_BLOCK  # noqa: E402

WINDOW, BS, MAX_TOKENS = 16, 4, 24
PROMPT_LENS = (5, 30, 97, 150)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("mistral-window")
    build_model(folder, MistralForCausalLM, MistralConfig(**BASE, sliding_window=WINDOW))
    gen = torch.Generator().manual_seed(77)
    prompts = [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return folder, prompts, hf_greedy(load_hf(folder), prompts, MAX_TOKENS, frozenset({BASE["eos_token_id"]}))


def _engine(folder, blocks: int = 64, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=blocks, block_size=BS, **kw)
    return LLMEngine(cfg)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_cache_smaller_than_a_prompt_serves_it_and_matches_transformers(window_model, chunked):
    """40 blocks of 4 hold 160 positions in all; four prompts of up to 150 tokens plus 24 outputs
    run side by side (about 7 blocks each at a time), with chunked prefill and without."""
    folder, prompts, ref = window_model
    engine = _engine(folder, 40 if chunked else 64, enable_chunked_prefill=chunked, max_num_batched_tokens=32)
    assert engine.model_cfg.kv_window == WINDOW
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, max(engine.blocks.num_held(s) for s in seqs))
    _assert_same_tokens([s.output_token_ids for s in seqs], ref)
    assert engine.blocks.num_used == 0 and engine.blocks.num_window_freed > 0
    if chunked:
        assert peak <= -(-(WINDOW + 32) // BS) + 1


def test_the_hand_off_sends_only_the_window_and_decode_frees_as_it_goes(window_model):
    folder, prompts, ref = window_model
    prefill, decode = _engine(folder, enable_prefix_caching=True), _engine(folder, enable_prefix_caching=True)
    payloads = prefill_payloads(prefill, prompts, GREEDY)
    seqs = []
    for pl in payloads:
        n = len(pl.token_ids)
        assert pl.kv_start == max(0, n - WINDOW + 1) // BS * BS and pl.kv.shape[2] == n - pl.kv_start
        seq = decode.admit_kv(unpack_kv(pack_kv(pl), decode.fingerprint))
        assert seq.block_table[: pl.kv_start // BS] == [NULL_BLOCK] * (pl.kv_start // BS)
        seqs.append(seq)
    while decode.has_work():
        decode.step()
        assert all(decode.blocks.num_held(s) <= WINDOW // BS + 2 for s in seqs if not s.is_finished)
    order = {s.request_id: s.output_token_ids for s in seqs}
    _assert_same_tokens([order[f"r{i}"] for i in range(len(prompts))], ref)
    assert decode.blocks.num_used == 0


def test_a_windowed_payload_with_wrong_prefix_hashes_is_refused(window_model):
    folder, prompts, _ = window_model
    prefill, decode = _engine(folder), _engine(folder)
    prefill.add_request("r", prompts[-1], GREEDY)
    payload = prefill.extract_kv(prefill.step()[0].seq) if not prefill.scheduler.waiting else None
    while payload is None:
        outs = [o for o in prefill.step() if o.prefill]
        payload = prefill.extract_kv(outs[0].seq) if outs else None
    assert payload.kv_start > 0
    payload.prefix_hashes = payload.prefix_hashes[::-1]
    with pytest.raises(ValueError, match="prefix hashes"):
        decode.admit_kv(payload)
    assert decode.blocks.num_used == 0
