"""The OpenAI-compatible HTTP server's chat completions, driven by the real openai SDK, on loopback."""

from __future__ import annotations

import openai
import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.chat import ChatTemplate
from tests.conftest import mixed_prompts
from tests.integration._openai import PLACEMENTS, grpc_result, sdk
from tests.integration._pipeline import local_pipeline


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_chat_renders_the_template_and_gives_the_grpc_text(embedded_dir, placement):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": mixed_prompts()[3]}]
    text = ChatTemplate.from_folder(embedded_dir).render(messages)
    ids = Tokenizer.from_folder(embedded_dir).encode(text, add_special_tokens=False)
    async with local_pipeline(embedded_dir, placement, http=True) as pipe:
        api = sdk(pipe)
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=10, temperature=0)
        full = await api.chat.completions.create(
            model="test-model", messages=messages, max_completion_tokens=10, temperature=0
        )
        assert full.choices[0].message.content == ref.text and full.choices[0].message.role == "assistant"
        assert full.usage.prompt_tokens == len(ids)
        stream = await api.chat.completions.create(
            model="test-model", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(parts) == ref.text


async def test_chat_without_a_template_is_a_clear_400(stories_dir):
    async with local_pipeline(stories_dir, "colocated", http=True) as pipe:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            await sdk(pipe).chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])


async def test_chat_with_a_real_instruct_model(smollm2_dir):
    """SmolLM2-135M-Instruct answers through the openai SDK exactly as gRPC does on the same ids."""
    from tests.conftest import smollm2_chat_ids

    question = "What is the capital of France?"
    ids = smollm2_chat_ids(smollm2_dir, question)
    async with local_pipeline(smollm2_dir, "split", num_kv_blocks=256, http=True) as pipe:
        ref = await grpc_result(pipe, prompt="", prompt_token_ids=ids, max_tokens=16, temperature=0)
        reply = await sdk(pipe).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
        )
        assert reply.choices[0].message.content == ref.text and "Paris" in ref.text
        assert reply.usage.prompt_tokens == len(ids)
