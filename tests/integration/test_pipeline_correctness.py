"""Split and colocated pipelines over real gRPC on loopback: output equals the transformers reference."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import DEFAULT_KV_STREAM
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.client import Client, make_request
from tests.conftest import STORIES_REFERENCES, hf_greedy, mixed_prompts
from tests.integration._pipeline import local_pipeline

PLACEMENTS = ["split", "colocated"]
# split placement with the KV hand-off that is not the default too ("whole" frame or "layer" by layer)
KV_STREAM_PLACEMENTS = [*PLACEMENTS, "split/" + ("layer" if DEFAULT_KV_STREAM == "whole" else "whole")]


def pipeline(model_dir, placement: str, **kw):
    """``local_pipeline``; a placement ``split/<kv_stream>`` names the prefill workers' KV hand-off."""
    placement, _, kv_stream = placement.partition("/")
    return local_pipeline(model_dir, placement, **({"kv_stream": kv_stream} if kv_stream else {}), **kw)


@pytest.mark.parametrize("placement", KV_STREAM_PLACEMENTS)
async def test_concurrent_greedy_matches_transformers(model_dir, placement):
    tok = Tokenizer.from_folder(model_dir)
    prompts = mixed_prompts()
    ids = [tok.encode(p) for p in prompts]
    lengths = sorted(len(i) for i in ids)
    assert lengths[0] <= 3 and lengths[-1] >= 150, lengths
    # plus a 1-token prompt sent as ids
    ids.append([ids[1][-1]])
    async with pipeline(model_dir, placement) as pipe, Client(pipe.address) as client:
        results = await asyncio.gather(
            *[client.generate(make_request("", prompt_token_ids=i, max_tokens=24, temperature=0)) for i in ids]
        )
        for prompt_ids, res in zip(ids, results):
            assert not res.error
            assert res.prompt_tokens == len(prompt_ids)
            assert res.token_ids == hf_greedy(model_dir, prompt_ids, 24), tok.decode(prompt_ids)
            assert res.text == tok.decode(res.token_ids)
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("kv_stream", ["whole", "layer"])
async def test_reused_kv_buffers_never_mix_requests(embedded_dir, kv_stream):
    """Split placement with every hand-off's host buffers reused (min_bytes=1, two cached): concurrent
    requests still decode from exactly their own KV. (A layer-wise prefill worker sends each layer
    from a tensor of its own; the decode worker receives every hand-off into reused buffers.)"""
    from pdserve.engine.kv.buffers import HostBuffers

    tok = Tokenizer.from_folder(embedded_dir)
    ids = [tok.encode(p) for p in mixed_prompts()]
    async with local_pipeline(embedded_dir, "split", kv_stream=kv_stream) as pipe, Client(pipe.address) as client:
        for w in pipe.workers:
            w.worker.kv_buffers = HostBuffers(min_bytes=1, max_buffers=2)
        for _ in range(2):
            results = await asyncio.gather(
                *[client.generate(make_request("", prompt_token_ids=i, max_tokens=24, temperature=0)) for i in ids]
            )
            for prompt_ids, res in zip(ids, results):
                assert res.token_ids == hf_greedy(embedded_dir, prompt_ids, 24), tok.decode(prompt_ids)
        assert all(w.worker.kv_buffers.reused > 0 for w in pipe.workers[kv_stream == "layer" :])
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_stories_reference_continuations(stories_dir, placement):
    async with local_pipeline(stories_dir, placement) as pipe, Client(pipe.address) as client:
        prompts = list(STORIES_REFERENCES)
        results = await asyncio.gather(
            *[client.generate(make_request(p, max_tokens=40, temperature=0)) for p in prompts]
        )
        for p, res in zip(prompts, results):
            assert res.token_ids == STORIES_REFERENCES[p]
            assert res.finish_reason == "length"
        assert results[0].text == (
            ", there was a little girl named Lily. She loved to play outside in the park. "
            "One day, she saw a big, red ball."
        )


@pytest.mark.parametrize("placement", KV_STREAM_PLACEMENTS)
async def test_max_tokens_exact(embedded_dir, placement):
    async with pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        for n in (1, 2, 17):
            res = await client.generate(
                make_request("Tell me a story.", max_tokens=n, temperature=0.8, seed=n, ignore_eos=True)
            )
            assert len(res.token_ids) == n and res.finish_reason == "length"
            chunks = [m async for m in client.stream(make_request("你好", max_tokens=n, ignore_eos=True))]
            final = chunks[-1].complete
            assert final.usage.completion_tokens == n
            assert sum(len(m.chunk.token_ids) for m in chunks if m.HasField("chunk")) == n
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_streamed_text_equals_one_shot_decode(embedded_dir, placement):
    """Random sampling on a byte-level BPE model splits multi-byte characters across tokens."""
    tok = Tokenizer.from_folder(embedded_dir)
    async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
        reqs = [
            make_request(p, max_tokens=40, temperature=1.0, seed=s, ignore_eos=True)
            for s, p in enumerate(["写一个关于猫的故事 🐱", "Emoji: 😀🎉", "混合 mixed text"] * 3)
        ]
        results = await asyncio.gather(*[client.generate(r) for r in reqs])
        split_chars = 0
        for res in results:
            assert res.text.encode() == tok.decode(res.token_ids).encode()
            split_chars += sum(1 for t in res.token_ids if "\ufffd" in tok.decode([t]))
        assert split_chars > 0, "no token carried a partial UTF-8 character; the test proves nothing"


async def test_seeded_sampling_same_everywhere(embedded_dir):
    req = dict(prompt="The weather today is", max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    outs = []
    for placement in PLACEMENTS:
        async with local_pipeline(embedded_dir, placement) as pipe, Client(pipe.address) as client:
            alone = await client.generate(make_request(**req))
            crowd = await asyncio.gather(
                client.generate(make_request(**req)),
                *[
                    client.generate(
                        make_request(f"other prompt {i} " * (i + 1), max_tokens=15, temperature=1.0, seed=i)
                    )
                    for i in range(5)
                ],
            )
            outs += [alone.token_ids, crowd[0].token_ids]
    assert all(o == outs[0] for o in outs), outs
    async with local_pipeline(embedded_dir, "split") as pipe, Client(pipe.address) as client:
        other = await client.generate(make_request(**{**req, "seed": 99}))
    assert other.token_ids != outs[0]


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_stop_string_truncates(stories_dir, placement):
    async with local_pipeline(stories_dir, placement) as pipe, Client(pipe.address) as client:
        res = await client.generate(make_request("Once upon a time", max_tokens=40, temperature=0, stop=["Lily."]))
        assert res.finish_reason == "stop"
        assert res.text == ", there was a little girl named "
        assert len(res.token_ids) < 40
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_smollm2_chat_prompts_match_transformers(smollm2_dir, placement):
    """A real 30-layer GQA model from a GGUF file, chat prompts rendered with its template (fp32)."""
    from tests.conftest import smollm2_chat_ids

    questions = ["What is the capital of France?", "Write a haiku about the sea.", "你好，请介绍一下你自己。"]
    ids = [smollm2_chat_ids(smollm2_dir, q) for q in questions]
    async with local_pipeline(smollm2_dir, placement, num_kv_blocks=256) as pipe, Client(pipe.address) as client:
        results = await asyncio.gather(
            *[client.generate(make_request("", prompt_token_ids=i, max_tokens=20, temperature=0)) for i in ids]
        )
        for prompt_ids, res in zip(ids, results):
            assert not res.error
            assert res.token_ids == hf_greedy(smollm2_dir, prompt_ids, 20)
        assert "Paris" in results[0].text
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("budget", [16, 37])
async def test_chunked_prefill_and_prefix_reuse_match_transformers(embedded_dir, placement, budget):
    """Budgets that cut prompts at block boundaries (16 = block_size) and off them (37), with
    decodes running beside the chunks; then the same prompts again, served from the prefix cache."""
    from pdserve.rpc.auth import internal_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    tok = Tokenizer.from_folder(embedded_dir)
    ids = [tok.encode(p) for p in mixed_prompts()]
    async with (
        local_pipeline(embedded_dir, placement, max_num_batched_tokens=budget) as pipe,
        Client(pipe.address) as client,
    ):
        for _ in range(2):
            results = await asyncio.gather(
                *[client.generate(make_request("", prompt_token_ids=i, max_tokens=24, temperature=0)) for i in ids]
            )
            for prompt_ids, res in zip(ids, results):
                assert res.token_ids == hf_greedy(embedded_dir, prompt_ids, 24), tok.decode(prompt_ids)
        assert await pipe.wait_idle() == 0
        prefilling = pipe.workers[0]  # the prefill worker, or the colocated one
        async with internal_channel(prefilling.address, None) as ch:
            stats = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
        reusable = sum((len(i) - 1) // 16 * 16 for i in ids)  # full blocks before each prompt's last token
        assert reusable > 100 and stats.prefix_hit_tokens >= reusable, "the second pass did not reuse its prefixes"
        assert stats.prefix_query_tokens >= 2 * sum(len(i) for i in ids)
