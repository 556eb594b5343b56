"""A prefill worker and a decode worker that quantize the same model differently compute different KV:
the router refuses the pair at start, and the decode worker refuses the prefill worker's KV, naming
the quantization of each."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from pdserve.engine.kv.codec import KvCodecError, KvPayload, pack_kv, unpack_kv
from pdserve.v1 import worker_pb2, worker_pb2_grpc


def _payload(fp, request_id: str) -> bytes:
    kv = torch.zeros(fp.num_layers, 2, 3, fp.num_kv_heads, fp.head_dim, dtype=getattr(torch, fp.dtype))
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "max_tokens": 4, "ignore_eos": True}
    return pack_kv(KvPayload(request_id, fp, [1, 2, 3], 4, sampling, kv))


async def test_other_quantization_is_refused_at_start_and_per_payload(embedded_dir):
    import pdserve.decode_worker.worker as decode
    import pdserve.prefill_worker.worker as prefill
    import pdserve.router.grpc_api as router
    from pdserve.engine.config import EngineConfig

    cfg = EngineConfig(model=str(embedded_dir), dtype="float32", num_kv_blocks=64)
    p = await prefill.serve(dataclasses.replace(cfg, quantization="int8"))
    d = await decode.serve(cfg)
    try:
        p_fp, d_fp = p.worker.engine.fingerprint, d.worker.engine.fingerprint
        assert p_fp.mismatches(d_fp) == ["quantization 'int8' != 'none'"]
        with pytest.raises(KvCodecError, match="model fingerprint mismatch: quantization 'int8' != 'none'"):
            unpack_kv(_payload(p_fp, "x"), d_fp)
        with pytest.raises(RuntimeError, match="different models"):
            await router.serve(embedded_dir, prefill=[p.address], decode=[d.address])
        async with grpc.aio.insecure_channel(d.address) as ch:
            stub = worker_pb2_grpc.DecodeServiceStub(ch)
            stream = stub.Decode(worker_pb2.DecodeRequest(request_id="q1", kv_timeout_s=10))
            await stream.initial_metadata()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushKv(iter([worker_pb2.KvChunk(request_id="q1", data=_payload(p_fp, "q1"))]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "quantization 'int8' != 'none'" in info.value.details()
            stream.cancel()
    finally:
        await p.stop()
        await d.stop()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
async def test_a_quantized_split_pipeline_decodes_as_one_quantized_engine(stories_dir, scheme):
    """Prefill and decode workers that both quantize (stories260K, float32 activations): each
    request's greedy tokens, through the KV hand-off, equal one quantized engine's own."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams
    from pdserve.router.client import Client, make_request
    from tests.conftest import STORIES_REFERENCES
    from tests.integration._pipeline import local_pipeline

    prompts = list(STORIES_REFERENCES)
    engine = LLMEngine(EngineConfig(model=str(stories_dir), dtype="float32", num_kv_blocks=64, quantization=scheme))
    ids = [engine.tokenizer.encode(p) for p in prompts]
    want = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=24))
    async with local_pipeline(stories_dir, "split", quantization=scheme) as pipe, Client(pipe.address) as client:
        for w in pipe.workers:  # both roles quantized (stories' greedy tokens happen not to change)
            assert w.worker.engine.fingerprint.quantization == scheme
            assert type(w.worker.engine.runner.model.layers[0].attn.qkv).__name__ == f"Int{scheme[3]}Linear"
        for prompt_ids, expected in zip(ids, want):
            res = await client.generate(make_request("", prompt_token_ids=prompt_ids, max_tokens=24, temperature=0))
            assert res.token_ids == expected
