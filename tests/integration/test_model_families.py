"""Each model family through real gRPC pipelines on loopback: greedy output equals transformers'
``generate()`` in split and colocated placement, with chunked prefill and prefix caching and
without; and a split pair of two families refuses the KV between them.

The checkpoints are the tiny random ones of tests/engine/models/_layout_cases.py and _gemma_cases.py
(built by transformers itself, seeded, float32, with the stories260K tokenizer).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.router.client import Client, make_request
from tests.engine.models._gemma_cases import build_gemma
from tests.engine.models._layout_cases import LONG_FACTORS, NEEDS_TOKENIZER, _spec
from tests.engine.models._tiny_models import BASE, build_model, hf_greedy, load_hf
from tests.integration._pipeline import local_pipeline

pytestmark = NEEDS_TOKENIZER
pytest.importorskip("transformers")

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "phi3", "phi3_longrope", "gemma2", "gemma3"]  # Gemma: windows of 16
MAX_TOKENS = 32
PROMPT_LENS = (1, 5, 23, 70, 150)
LONG_PROMPT_LENS = (65, 70, 111, 150)  # LongRoPE's long factors: past the original 64 positions
MODES = {
    # 16-token chunks beside the decoding rows; the second pass reads its prefixes from the cache
    "chunked+prefix-cache": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True),
    "whole-prompts": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
}


def _prompts(name: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    lens = LONG_PROMPT_LENS if name in LONG_FACTORS else PROMPT_LENS
    return [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (checkpoint folder, transformers' greedy tokens for ``_prompts(name)``), built once."""
    from pdserve.engine.text.tokenizer import Tokenizer

    built: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]]]:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            if name.startswith("gemma"):
                build_gemma(folder, name)
            else:
                model_cls, config, kwargs = _spec(name)
                build_model(folder, model_cls, config, **kwargs)
            eos = Tokenizer.from_folder(folder).eos_token_ids
            built[name] = folder, hf_greedy(load_hf(folder), _prompts(name), MAX_TOKENS, eos)
        return built[name]

    return get


async def _prefix_hit_tokens(address: str) -> int:
    from pdserve.rpc.auth import internal_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    async with internal_channel(address, None) as ch:
        stats = await worker_pb2_grpc.WorkerServiceStub(ch).GetStats(worker_pb2.GetStatsRequest())
    return stats.prefix_hit_tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("placement", ["split", "colocated"])
@pytest.mark.parametrize("name", FAMILIES)
async def test_greedy_matches_transformers(family, name, placement, mode):
    folder, ref = family(name)
    prompts = _prompts(name)
    assert sum(len(r) for r in ref) > 2 * MAX_TOKENS  # the comparison is not vacuous
    async with local_pipeline(folder, placement, **MODES[mode]) as pipe, Client(pipe.address) as client:
        for _ in range(2):
            results = await asyncio.gather(
                *[
                    client.generate(make_request("", prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0))
                    for p in prompts
                ]
            )
            for i, (res, want) in enumerate(zip(results, ref, strict=True)):
                assert not res.error
                assert res.token_ids == want, f"{name} prompt {i} ({len(prompts[i])} tokens)"
        reusable = sum((len(p) - 1) // 16 * 16 for p in prompts)  # full blocks before each last token
        hits = await _prefix_hit_tokens(pipe.workers[0].address)  # the prefill worker, or the colocated one
        assert hits >= reusable > 0 if MODES[mode]["enable_prefix_caching"] else hits == 0
        assert await pipe.wait_idle() == 0


@pytest.mark.parametrize("kv_stream", ["whole", "layer"])
async def test_a_hybrid_push_sends_windowed_layers_only_their_window(family, kv_stream):
    """Gemma 3 (sliding, global, sliding; window 16) in split placement, the KV pushed whole or layer by
    layer: greedy output equals transformers', and the decode worker received fewer bytes than the
    dense KV of every layer (its windowed layers got only their window)."""
    folder, ref = family("gemma3")
    prompts = _prompts("gemma3")
    pushed = dense = 0
    async with local_pipeline(folder, "split", kv_stream=kv_stream) as pipe, Client(pipe.address) as client:
        for p, want in zip(prompts, ref, strict=True):
            res = await client.generate(make_request("", prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0))
            assert not res.error and res.token_ids == want
            pushed += res.timings.kv_transfer_bytes
            dense += 3 * 2 * len(p) * BASE["num_key_value_heads"] * 16 * 4  # 3 layers, K and V, head_dim 16, fp32
        assert await pipe.wait_idle() == 0
    assert 0 < pushed < 0.8 * dense  # the 150-token prompt's windowed layers get 16-19 of its positions


async def test_split_pair_of_two_families_refuses_the_kv(family, tmp_path):
    """Qwen3 prefill beside a Llama decode worker of the same KV shapes (2 layers, 2 KV heads of 32)
    and tokenizer: refused at start and per payload, naming the architectures."""
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv.codec import KvPayload, pack_kv
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    qwen3, _ = family("qwen3")
    model_cls, config, _ = _spec("head_dim")  # a Llama with head_dim 32
    llama = build_model(tmp_path / "llama", model_cls, config)
    p = await prefill.serve(EngineConfig(model=str(qwen3), dtype="float32", num_kv_blocks=64))
    d = await decode.serve(EngineConfig(model=str(llama), dtype="float32", num_kv_blocks=64))
    try:
        fp = p.worker.engine.fingerprint
        other = d.worker.engine.fingerprint
        assert (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.layers) == (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
            other.layers,
        )
        assert fp.mismatches(other)[0] == "architecture 'Qwen3ForCausalLM' != 'LlamaForCausalLM'"
        with pytest.raises(RuntimeError, match="different models"):
            await router.serve(qwen3, prefill=[p.address], decode=[d.address])
        kv = torch.zeros(fp.num_layers, 2, 3, fp.num_kv_heads, fp.head_dim)
        sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": 4, "ignore_eos": True}
        frame = pack_kv(KvPayload("f1", fp, [5, 6, 7], 8, sampling, kv))
        async with grpc.aio.insecure_channel(d.address) as ch:
            stub = worker_pb2_grpc.DecodeServiceStub(ch)
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="f1", kv_timeout_s=10))
            await stream.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushKv(iter([worker_pb2.KvChunk(request_id="f1", data=frame)]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "architecture 'Qwen3ForCausalLM' != 'LlamaForCausalLM'" in info.value.details()
            stream.cancel()
    finally:
        await p.stop()
        await d.stop()
