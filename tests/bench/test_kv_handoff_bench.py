"""benchmarks/kv_handoff.py times the prefill of one prompt several times (min-of-N) beside the
hand-off: each repeat must compute the whole prompt, not read it back from the prefix cache (which
once made its TTFT share of a 1,024-token hand-off read 54 % instead of 10 %)."""

from __future__ import annotations

import argparse

from pdserve.engine.llm_engine import LLMEngine
from tests.bench._scripts import load_script

K = load_script("kv_handoff")


def test_each_prefill_repeat_computes_the_whole_prompt():
    args = argparse.Namespace(block_size=16, threads=None)
    engine = LLMEngine(K.engine_config("float32", 64, args))
    ids = list(range(3, 51))  # three full blocks and a part
    for i in range(3):
        seq, ms = K.prefill(engine, f"p{i}", ids)
        assert seq.num_cached_tokens == 0 and ms > 0
        engine.scheduler.finish(seq)
