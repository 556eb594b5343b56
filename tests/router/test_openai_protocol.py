"""OpenAI request bodies to GenerateRequest: shapes checked here, values left to the one validator."""

from __future__ import annotations

import json

import pytest

from pdserve.router.openai_protocol import BadRequest, ChatRequest, CompletionRequest
from pdserve.router.openai_protocol import parse as parse_json


def parse(model, body):
    return parse_json(model, json.dumps(body))


def test_completion_fields_map_onto_the_generate_request():
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                    "top_k": -1, "seed": 3, "stop": "\n", "ignore_eos": True, "user": "ignored"})
    g = req.to_generate_request()
    assert g.prompt == "hi" and g.max_tokens == 7 and g.stop == ["\n"] and g.ignore_eos
    assert g.sampling.temperature == 0.5 and abs(g.sampling.top_p - 0.9) < 1e-6 and g.sampling.seed == 3
    assert g.sampling.HasField("top_k") and g.sampling.top_k == 0  # vLLM's -1: disabled
    unset = parse(CompletionRequest, {"prompt": [[1, 2, 3]]}).to_generate_request()
    assert list(unset.prompt_token_ids) == [1, 2, 3]
    assert not unset.HasField("max_tokens") and not unset.sampling.HasField("temperature")


def test_chat_prefers_max_completion_tokens():
    req = parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}],
                              "max_tokens": 5, "max_completion_tokens": 9})
    assert req.to_generate_request([1]).max_tokens == 9
    assert req.messages[0].for_template()["content"] == "ab"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "seed": -5}, "seed"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "ignore_eos": "no"}, "ignore_eos"),
    ({}, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_bad_shapes_name_their_field(body, param):
    with pytest.raises(BadRequest) as info:
        parse(CompletionRequest, body).to_generate_request()
    assert info.value.param == param


def test_values_are_left_to_the_validator():
    """max_tokens 0 and a negative temperature pass the shape check: the router's validator refuses them."""
    g = parse(CompletionRequest, {"prompt": "hi", "max_tokens": 0, "temperature": -1}).to_generate_request()
    assert g.HasField("max_tokens") and g.max_tokens == 0 and g.sampling.temperature == -1
    with pytest.raises(BadRequest, match="batched"):
        parse(CompletionRequest, {"prompt": ["a", "b"]}).to_generate_request()
    with pytest.raises(BadRequest, match="JSON object"):
        parse(CompletionRequest, [1, 2])
    with pytest.raises(BadRequest, match="text content"):
        parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).messages[0].for_template()
