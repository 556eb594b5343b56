"""Each model family in bfloat16 against transformers in float32, within the budget that
``_bf16_check.assert_close_to_float32`` states (transformers' own bf16 error, times 1.5): logits of
every prefill position and of a paged decode step, and greedy output by the near-tie rule, with
prompts longer than the sliding windows (16 in Gemma and the Mistral case, 48 in Phi-3) and Gemma 2's
soft-capped scores."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._bf16_check import assert_close_to_float32
from tests.engine.models._gemma_cases import build_gemma
from tests.engine.models._layout_cases import NEEDS_TOKENIZER, _spec
from tests.engine.models._tiny_models import BASE, build_model

pytestmark = NEEDS_TOKENIZER
pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "phi3", "mistral_window", "gemma2", "gemma3"]
PROMPT_LENS = (3, 21, 70, 130)
MAX_TOKENS = 16


def _build(folder, name: str) -> None:
    if name.startswith("gemma"):
        build_gemma(folder, name)
    elif name == "mistral_window":
        from transformers import MistralConfig, MistralForCausalLM

        build_model(folder, MistralForCausalLM, MistralConfig(**BASE, sliding_window=16))
    else:
        model_cls, config, kwargs = _spec(name)
        build_model(folder, model_cls, config, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_family_in_bf16_is_within_tolerance(tmp_path, name, backend):
    from transformers import AutoModelForCausalLM

    _build(tmp_path, name)
    hf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64, block_size=16, attention_backend=backend)
    )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    assert_close_to_float32(engine, hf32, hf16, prompts, MAX_TOKENS)
    assert engine.blocks.num_used == 0
