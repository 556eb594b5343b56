"""``--attention-backend sdpa-prefill``: steps of whole prompts go through SDPA, every other step
through the paged kernel, and greedy output still equals transformers' in float32 (with chunked
prefill, prefix caching and a sliding window, which take the kernel's path for cached positions)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._layout_cases import NEEDS_TOKENIZER, _assert_same_tokens, _prompts, _spec
from tests.engine.models._tiny_models import BASE, build_model, hf_greedy, load_hf

pytestmark = NEEDS_TOKENIZER
pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.models import attention  # noqa: E402
from pdserve.engine.models.kernels import KernelUnavailable, load_cpu_kernels  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402

MAX_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    try:
        load_cpu_kernels()
    except KernelUnavailable as exc:
        pytest.skip(f"the C++ kernel cannot be built here: {exc}")


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_equals_transformers_and_both_paths_run(tmp_path, monkeypatch, name, chunked):
    if name == "mistral_window":
        from transformers import MistralConfig, MistralForCausalLM

        build_model(tmp_path, MistralForCausalLM, MistralConfig(**BASE, sliding_window=16))
    else:
        model_cls, config, kwargs = _spec(name)
        build_model(tmp_path, model_cls, config, **kwargs)
    calls = {"sdpa": 0, "kernel": 0}
    whole, kernel = attention.TorchAttention.attend_whole, attention.CpuPagedAttention.decode

    def count_whole(self, *args):
        calls["sdpa"] += 1
        return whole(self, *args)

    def count_kernel(self, *args):
        calls["kernel"] += 1
        return kernel(self, *args)

    monkeypatch.setattr(attention.TorchAttention, "attend_whole", count_whole)
    monkeypatch.setattr(attention.CpuPagedAttention, "decode", count_kernel)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            attention_backend="sdpa-prefill",
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=32,
            enable_prefix_caching=chunked,
        )
    )
    assert engine.runner.model.attention.name == "sdpa-prefill"
    prompts = _prompts()
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, hf_greedy(load_hf(tmp_path), prompts, MAX_TOKENS, engine.eos_token_ids))
    assert calls["kernel"] > 0  # decode steps, and chunks after the first
    assert calls["sdpa"] > 0  # prompts computed whole, beside decode rows too


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="choose auto, cpu-paged, sdpa-prefill, torch"):
        attention.select_backend("flash", torch.device("cpu"), torch.float32, 4, 2, 16, None)
