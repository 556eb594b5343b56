"""OpenAI request bodies to GenerateRequest: shapes checked here, values left to the one validator."""

from __future__ import annotations

import functools
import json

import pytest

from pdserve.router.openai_protocol import PB, BadRequest, ChatRequest, CompletionRequest
from pdserve.router.openai_protocol import parse as parse_json
from pdserve.router.openai_responses import ResponseShape, timings_json


def parse(model, body):
    return parse_json(model, json.dumps(body))


def test_completion_fields_map_onto_the_generate_request():
    req = parse(
        CompletionRequest,
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 3,
            "stop": "\n",
            "ignore_eos": True,
            "user": "ignored",
        },
    )
    g = req.to_generate_request()
    assert g.prompt == "hi" and g.max_tokens == 7 and g.stop == ["\n"] and g.ignore_eos
    assert g.sampling.temperature == 0.5 and abs(g.sampling.top_p - 0.9) < 1e-6 and g.sampling.seed == 3
    assert g.sampling.HasField("top_k") and g.sampling.top_k == 0  # vLLM's -1: disabled
    unset = parse(CompletionRequest, {"prompt": [[1, 2, 3]]}).to_generate_request()
    assert list(unset.prompt_token_ids) == [1, 2, 3]
    assert unset.max_tokens == 16 and not unset.sampling.HasField("temperature")  # OpenAI's completions default
    assert parse(CompletionRequest, {"prompt": "hi", "max_tokens": None}).to_generate_request().max_tokens == 16


def test_chat_prefers_max_completion_tokens():
    req = parse(
        ChatRequest,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 9,
        },
    )
    assert req.to_generate_request([1]).max_tokens == 9
    assert req.messages[0].for_template()["content"] == "ab"
    unset = parse(ChatRequest, {"messages": [{"role": "user", "content": "a"}]}).to_generate_request([1])
    assert not unset.HasField("max_tokens")  # chat: the rest of the context window, as vLLM


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "seed": -5}, "seed"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "ignore_eos": "no"}, "ignore_eos"),
        ({}, "prompt"),
        ({"prompt": "hi", "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ],
)
def test_bad_shapes_name_their_field(body, param):
    with pytest.raises(BadRequest) as info:
        parse(CompletionRequest, body).to_generate_request()
    assert info.value.param == param


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "hi", "n": 0}, "n must be 1 (one choice per request), got 0"),
        ({"prompt": "hi", "n": 3}, "n must be 1 (one choice per request), got 3; send 3 requests for 3 choices"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens must be >= 1, got -1"),  # as the validator says for 0
        (
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -2},
            "max_completion_tokens must be >= 1, got -2",
        ),
        ({"prompt": "hi", "top_k": -2}, "top_k must be >= -1 (-1 or 0 disables), got -2"),
        ({"prompt": "hi", "seed": -5}, "seed must be >= 0, got -5"),
        ({"prompt": "hi", "max_tokens": 1 << 32}, f"max_tokens must be <= {(1 << 32) - 1}, got {1 << 32}"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
            "messages.1.role: role must be one of system, developer, user, assistant, tool, got 'wizard'",
        ),
        (
            {"messages": [{"role": "user"}]},
            "messages.0: a user message needs content: a string or a list of text parts",
        ),
    ],
)
def test_messages_say_what_is_wrong_and_what_is_allowed(body, message):
    with pytest.raises(BadRequest) as info:
        parse(ChatRequest if "messages" in body else CompletionRequest, body)
    assert str(info.value) == message


CHAT = {"messages": [{"role": "user", "content": "a"}]}


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1"),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1, got 0"),
        # max_completion_tokens wins, but an invalid max_tokens beside it is still an error, and vice versa
        ({**CHAT, "max_completion_tokens": 3, "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        (
            {**CHAT, "max_completion_tokens": 0, "max_tokens": 3},
            "max_completion_tokens",
            "max_completion_tokens must be >= 1, got 0",
        ),
    ],
)
def test_token_limits_below_one_name_the_field_sent(body, param, message):
    with pytest.raises(BadRequest) as info:
        parse(ChatRequest if "messages" in body else CompletionRequest, body)
    assert (info.value.param, str(info.value)) == (param, message)


def test_the_validator_is_told_what_this_api_calls_the_fields():
    assert parse(CompletionRequest, {"prompt": [1, 2]}).field_names() == {"prompt_token_ids": "prompt"}
    assert parse(ChatRequest, {**CHAT, "max_tokens": 4}).field_names().get("max_tokens", "max_tokens") == "max_tokens"
    both = parse(ChatRequest, {**CHAT, "max_tokens": 4, "max_completion_tokens": 2})
    assert both.field_names()["max_tokens"] == "max_completion_tokens" and both.to_generate_request([1]).max_tokens == 2
    assert both.field_names()["prompt"] == "messages"


@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "a\\ud800b", "\\ud800\\u0041"])
def test_a_lone_surrogate_is_named_as_such(escape):
    with pytest.raises(BadRequest) as info:
        parse_json(CompletionRequest, f'{{"prompt": "{escape}"}}')
    assert str(info.value).startswith("the request body has a lone UTF-16 surrogate escape")
    assert "at line 1 column" in str(info.value) and "valid Unicode" in str(info.value)
    assert parse_json(CompletionRequest, '{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"  # a pair is fine
    with pytest.raises(BadRequest, match="not valid JSON: invalid escape"):
        parse_json(CompletionRequest, '{"prompt": "\\u12"}')


def test_timings_carry_every_field_of_the_grpc_message():
    t = PB.Timings(
        queue_ns=1,
        prefill_ns=2,
        kv_transfer_ns=3,
        decode_ns=4,
        total_ns=5,
        kv_transfer_bytes=6,
        prefilled_on_decode=True,
        cached_prompt_tokens=32,
    )
    body = timings_json(t)
    assert body["prefilled_on_decode"] is True and body["cached_prompt_tokens"] == 32
    assert body["kv_transfer_bytes"] == 6 and body["prefill_s"] == 2e-9
    assert {f.name.replace("_ns", "_s") for f in PB.Timings.DESCRIPTOR.fields} == set(body)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_chunk_with_nothing_to_say_is_not_sent(kind):
    shape = ResponseShape(kind, "r1", "m")
    assert shape.delta("", first=False) is None  # the bytes of a character held back
    assert shape.delta("", PB.FINISH_REASON_LENGTH)["choices"][0]["finish_reason"] == "length"
    first = shape.delta("", first=True)
    if kind == "chat":  # chat's first chunk carries the role
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        assert first is None
    text = shape.delta("é")["choices"][0]
    assert (text["text"] if kind == "completion" else text["delta"]["content"]) == "é"


def test_values_are_left_to_the_validator():
    """A negative temperature, top_p 0 and long stop strings pass the shape check: the router's validator
    refuses them (and names the field, see test_validation)."""
    g = parse(
        CompletionRequest, {"prompt": "hi", "temperature": -1, "top_p": 0, "stop": ["x" * 5000]}
    ).to_generate_request()
    assert g.sampling.temperature == -1 and g.sampling.HasField("top_p") and g.sampling.top_p == 0
    assert list(g.stop) == ["x" * 5000]
    with pytest.raises(BadRequest, match="batched"):
        parse(CompletionRequest, {"prompt": ["a", "b"]}).to_generate_request()
    with pytest.raises(BadRequest, match="JSON object"):
        parse(CompletionRequest, [1, 2])
    with pytest.raises(BadRequest, match="text content"):
        parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).messages[
            0
        ].for_template()


@pytest.mark.parametrize(
    "field,value",
    [
        ("best_of", 2),
        ("logit_bias", {"50256": -100}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("repetition_penalty", 1.2),
        ("response_format", {"type": "json_object"}),
        ("tools", [{"type": "function"}]),
        ("suffix", "the end"),
        ("presence_penalty", True),
    ],
)
def test_fields_that_would_change_the_output_are_refused_not_ignored(field, value):
    for req in (
        CompletionRequest(prompt="hi", **{field: value}),
        ChatRequest(messages=[{"role": "user", "content": "hi"}], **{field: value}),
    ):
        make = (
            req.to_generate_request
            if isinstance(req, CompletionRequest)
            else functools.partial(req.to_generate_request, [1, 2])
        )
        with pytest.raises(BadRequest) as info:
            make()
        assert info.value.param == field and f"{field} is not supported" in str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("best_of", 1),
        ("logit_bias", {}),
        ("presence_penalty", 0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("response_format", {"type": "text"}),
        ("tools", []),
        ("suffix", ""),
        ("tools", None),
    ],
)
def test_their_neutral_values_are_accepted(field, value):
    req = CompletionRequest(prompt="hi", **{field: value}).to_generate_request()
    assert req.prompt == "hi"


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_finite_value_beyond_float32_is_named_not_read_as_inf(field):
    with pytest.raises(BadRequest, match=rf"{field} 1e\+308 is out of range: sampling values are float32") as info:
        parse(CompletionRequest, {"prompt": "hi", field: 1e308})._generate_request(prompt_token_ids=[1])
    assert info.value.param == field
