"""``--placement auto`` on a local Ray instance: two switchable workers (first roles 1 prefill +
1 decode) behind the router; output equals transformers and no KV block is left in use."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.client import Client, make_request
from tests.conftest import hf_greedy, mixed_prompts

ray = pytest.importorskip("ray")


def test_an_auto_cluster_serves_greedy_output_on_switchable_workers():
    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.launch import start_cluster
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.text.tokenizer import Tokenizer
    from tests.integration.test_ray_cluster import assert_no_blocks_left

    cfg = ClusterConfig(EngineConfig(model="embedded", dtype="float32", num_kv_blocks=512), "auto", router_port=0)
    with start_cluster(cfg) as cluster:
        assert sorted(cluster.workers.values()) == ["decode", "prefill"]

        async def run():
            async with Client(cluster.address) as client:
                info = await client.model_info(cluster_secret=cluster.secret)
                assert info.placement == "auto" and sorted(w.role for w in info.workers) == ["decode", "prefill"]
                tok = Tokenizer.from_folder(info.model_path)
                prompts = mixed_prompts()
                results = await asyncio.gather(
                    *[client.generate(make_request(p, max_tokens=16, temperature=0)) for p in prompts]
                )
                for p, res in zip(prompts, results):
                    assert res.token_ids == hf_greedy(info.model_path, tok.encode(p), 16)
            await assert_no_blocks_left(cluster)

        asyncio.run(run())
