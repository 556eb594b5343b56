"""Prefix caching in the block manager, through a real engine (float32): reuse computes only the
new tokens and changes no output; unwritten blocks are never shared; collisions are caught;
cached blocks are reclaimable."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.prefix_hash import prefix_hashes

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BS = 16


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=BS, **kw))


def record_computed(engine: LLMEngine) -> list[int]:
    """Tokens each model step computes (summed over its sequences), recorded as steps run."""
    computed: list[int] = []
    original = engine.runner.run

    def run(batch):
        computed.append(sum(batch.num_query_tokens))
        return original(batch)

    engine.runner.run = run
    return computed


def solo(model_dir, prompt: list[int]) -> list[int]:
    return make_engine(model_dir, enable_prefix_caching=False).generate([prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def shared_prefix() -> list[int]:
    return [random.Random(5).randrange(1, 1000) for _ in range(3 * BS + 5)]


def test_a_shared_prefix_is_computed_once(embedded_dir, shared_prefix) -> None:
    engine = make_engine(embedded_dir)
    first = engine.generate([shared_prefix], GREEDY)[0]
    second_prompt = shared_prefix[: 3 * BS] + [7, 8, 9, 10, 11, 12, 13]
    computed = record_computed(engine)
    seq = engine.add_request("second", second_prompt, GREEDY)
    while engine.has_work():
        engine.step()
    assert seq.num_cached_tokens == 3 * BS
    assert computed[0] == len(second_prompt) - 3 * BS  # the prefill computes only the new tokens
    assert seq.output_token_ids == solo(embedded_dir, second_prompt)
    assert first == solo(embedded_dir, shared_prefix)
    assert engine.blocks.num_used == 0


def test_an_identical_prompt_reuses_all_but_its_last_token(embedded_dir, shared_prefix) -> None:
    """The last token is always computed (its logits are sampled); here the prompt is 3 blocks + 5,
    and a prompt of exactly 3 blocks reuses 2 of them plus 15 tokens recomputed."""
    engine = make_engine(embedded_dir)
    out = engine.generate([shared_prefix], GREEDY)[0]
    again = engine.add_request("again", shared_prefix, GREEDY)
    while engine.has_work():
        engine.step()
    assert again.num_cached_tokens == 3 * BS and again.output_token_ids == out
    exact = shared_prefix[: 3 * BS]
    engine.generate([exact], GREEDY)
    seq = engine.add_request("exact", exact, GREEDY)
    while engine.has_work():
        engine.step()
    assert seq.num_cached_tokens == 2 * BS and seq.output_token_ids == solo(embedded_dir, exact)


def test_identical_prompts_at_the_same_moment_share_no_unwritten_block(embedded_dir, shared_prefix) -> None:
    engine = make_engine(embedded_dir)
    a = engine.add_request("a", shared_prefix, GREEDY)
    b = engine.add_request("b", shared_prefix, GREEDY)
    while engine.has_work():
        engine.step()
    expected = solo(embedded_dir, shared_prefix)
    assert a.output_token_ids == b.output_token_ids == expected
    assert a.num_cached_tokens == b.num_cached_tokens == 0


def test_decode_tokens_enter_the_cache_for_the_next_turn(embedded_dir, shared_prefix) -> None:
    """A conversation's next turn (prompt + answer + new text) reuses the answer's blocks too."""
    engine = make_engine(embedded_dir)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    answer = engine.generate([shared_prefix], long)[0]
    turn = shared_prefix + answer + [3, 4, 5]
    seq = engine.add_request("turn2", turn, GREEDY)
    while engine.has_work():
        engine.step()
    # the last sampled token's KV was never written, so the cache ends one token before the answer does
    assert seq.num_cached_tokens == (len(shared_prefix) + len(answer) - 1) // BS * BS
    assert seq.output_token_ids == solo(embedded_dir, turn)


def test_a_forced_hash_collision_is_caught_by_the_token_check(embedded_dir, shared_prefix) -> None:
    engine = make_engine(embedded_dir)
    engine.blocks = engine.scheduler.blocks = BlockManager(
        engine.blocks.num_blocks, BS, True, hash_fn=lambda parent, tokens: b"same"
    )
    other = [t + 1 for t in shared_prefix]
    engine.generate([shared_prefix], GREEDY)
    seq = engine.add_request("other", other, GREEDY)
    while engine.has_work():
        engine.step()
    assert seq.num_cached_tokens == 0
    assert seq.output_token_ids == solo(embedded_dir, other)


def test_a_full_cache_admits_new_requests_by_evicting(embedded_dir) -> None:
    engine = make_engine(embedded_dir, num_kv_blocks=12)
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 1000) for _ in range(4 * BS + 1)] for _ in range(6)]
    for i, p in enumerate(prompts):  # each needs 5 blocks; 6 of them are 30 blocks through 12
        assert engine.generate([p], GREEDY)[0] == solo(embedded_dir, p), f"prompt {i}"
        assert engine.blocks.num_used == 0
        assert engine.blocks.num_free == 12 and engine.blocks.num_cached > 0
    # the most recent prompt is still cached; the first one was evicted
    assert engine.blocks.match_prefix(_probe(prompts[-1])) == 4 * BS


def _probe(prompt):
    from pdserve.engine.scheduling.sequence import Sequence

    return Sequence.new("probe", prompt, GREEDY)


def test_prefix_hashes_chain_on_the_parent() -> None:
    a = prefix_hashes(list(range(48)), 16)
    b = prefix_hashes([99] + list(range(1, 48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # one changed token renames every later block
    assert prefix_hashes(list(range(40)), 16) == a[:2]


def test_a_pinned_prefix_lets_the_payload_leave_it_out(embedded_dir, shared_prefix) -> None:
    """Prefill engine -> decode engine with the decode side holding a prefix: same tokens, fewer
    positions sent, and a payload naming a prefix the receiver does not hold is refused."""
    from pdserve.engine.kv.codec import pack_kv, unpack_kv

    prefill, decode = make_engine(embedded_dir), make_engine(embedded_dir)
    prompt = shared_prefix + [1, 2, 3]
    seq = decode.add_request("warm", shared_prefix, GREEDY)
    while decode.has_work():
        decode.step()
    assert decode.pin_prefix("r", prompt) == 3 * BS
    used = decode.blocks.num_used
    assert used == 3  # the held blocks are referenced, so no allocation can evict them
    p = _prefilled(prefill, "r", prompt)
    payload = unpack_kv(pack_kv(prefill.extract_kv(p, skip_tokens=3 * BS)), decode.fingerprint)
    assert payload.kv_start == 3 * BS and payload.kv.shape[2] == len(prompt) - 3 * BS
    wrong = unpack_kv(
        pack_kv(prefill.extract_kv(_prefilled(prefill, "x", prompt), skip_tokens=3 * BS)), decode.fingerprint
    )
    with pytest.raises(ValueError, match="holds no such prefix"):
        decode.admit_kv(wrong)  # request "x" has no prefix held
    out = decode.admit_kv(payload)
    assert out.num_cached_tokens == 3 * BS
    while decode.has_work():
        decode.step()
    assert out.output_token_ids == solo(embedded_dir, prompt)
    decode.unpin("r")
    assert decode.blocks.num_used == 0 and prefill.blocks.num_used == 0
    assert seq.is_finished


def _prefilled(engine: LLMEngine, rid: str, prompt: list[int]):
    seq = engine.add_request(rid, prompt, GREEDY)
    engine.step()
    return seq
