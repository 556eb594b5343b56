"""The router's one validator: defaults from the model's generation_config.json, as vLLM takes them;
refusals that name the field at fault."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.router.validation import (
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    InvalidRequest,
    sampling_defaults,
    validate,
)
from pdserve.v1 import generate_pb2 as PB


def test_unset_sampling_follows_generation_config(tmp_path, embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    assert sampling_defaults(embedded_dir) == {}  # the embedded model sets none: 1.0 / 1.0 / 0
    plain = validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size)
    assert (plain.sampling.temperature, plain.sampling.top_p, plain.sampling.top_k) == (1.0, 1.0, 0)

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.0, "top_p": 0.5, "top_k": 7, "bos_token_id": 0})
    )
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.0, "top_p": 0.5, "top_k": 7}
    unset = validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size, defaults)
    assert (unset.sampling.temperature, unset.sampling.top_p, unset.sampling.top_k) == (0.0, 0.5, 7)
    assert unset.sampling.seed == 0  # greedy by the model's default: no random seed drawn
    given = validate(
        PB.GenerateRequest(prompt="hi", sampling=PB.SamplingParams(temperature=0.8, top_k=0)),
        tok,
        2048,
        tok.vocab_size,
        defaults,
    )
    assert abs(given.sampling.temperature - 0.8) < 1e-6 and given.sampling.top_k == 0 and given.sampling.top_p == 0.5


def test_a_broken_generation_config_gives_no_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot", "top_k": True}))
    assert sampling_defaults(tmp_path) == {}


def _refusal(tok, names=None, max_model_len=2048, **fields) -> InvalidRequest:
    sampling = {k: fields.pop(k) for k in ("temperature", "top_p", "top_k") if k in fields}
    req = PB.GenerateRequest(sampling=PB.SamplingParams(**sampling), **{"prompt": "hi", **fields})
    with pytest.raises(InvalidRequest) as info:
        validate(req, tok, max_model_len, tok.vocab_size, names=names)
    return info.value


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1, got 0"),
        (dict(temperature=-1.0), "temperature", "temperature must be"),
        (dict(temperature=float("nan")), "temperature", "temperature must be a number, got NaN"),
        (dict(top_p=0.0), "top_p", "top_p must be in (0, 1]"),
        (dict(top_p=float("nan")), "top_p", "top_p must be a number, got NaN"),
        (dict(top_k=-3), "top_k", "top_k must be >= -1 (-1 or 0 disables), got -3"),
        (dict(max_tokens=5000), "max_tokens", "exceeds the context window"),
        (dict(prompt=""), "prompt", "prompt is empty"),
        (dict(prompt="", prompt_token_ids=[5, 10**6]), "prompt_token_ids", "out of range"),
        (dict(stop=[""]), "stop", "stop strings must be non-empty"),
        (dict(stop=["."] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS} stop strings"),
        (dict(request_id="x" * 300), "request_id", "request_id has 300 characters; at most 256"),
    ],
)
def test_every_field_error_names_its_field(embedded_dir, fields, param, words):
    err = _refusal(Tokenizer.from_folder(embedded_dir), **fields)
    assert err.param == param and words in str(err), (err.param, str(err))


def test_errors_name_the_field_as_the_client_called_it(embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    names = {"max_tokens": "max_completion_tokens", "prompt": "messages"}
    zero = _refusal(tok, names, max_tokens=0)
    assert (zero.param, str(zero)) == ("max_completion_tokens", "max_completion_tokens must be >= 1, got 0")
    over = _refusal(tok, names, max_model_len=64, max_tokens=100)
    assert over.param == "max_completion_tokens" and "+ max_completion_tokens (100) =" in str(over)
    assert "max_tokens" not in str(over)
    assert _refusal(tok, names, prompt="").param == "messages"
    several = _refusal(tok, names, temperature=-1.0, top_p=2.0)  # every problem listed, param the first one's
    assert several.param == "temperature" and "top_p must be in (0, 1]" in str(several)


def test_prompt_and_prompt_token_ids_together_are_refused(embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    err = _refusal(tok, prompt="hi", prompt_token_ids=[1, 2])
    assert "prompt and prompt_token_ids are both set; give one or the other" in str(err)
    assert list(validate(PB.GenerateRequest(prompt_token_ids=[1, 2]), tok, 2048, tok.vocab_size).prompt_token_ids) == [
        1,
        2,
    ]
    assert validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size).prompt_token_ids == tok.encode("hi")


@pytest.mark.parametrize(
    "request_id, index",
    [
        ("a\nb\x00c/..", 1),
        ("tab\there", 3),
        ("\x1b[31mred", 0),
        ("del\x7f", 3),
        ("next-line\x85", 9),
        ("x" * 300 + "\r", 300),
    ],
)
def test_request_ids_with_control_characters_are_refused(embedded_dir, request_id, index):
    err = _refusal(Tokenizer.from_folder(embedded_dir), request_id=request_id)
    assert err.param == "request_id"
    assert "request_id must not contain control characters" in str(err)
    assert f"found {request_id[index]!r} at index {index}" in str(err)
    assert request_id not in str(err)  # the id itself is not echoed


def test_printable_request_ids_are_kept(embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    for request_id in ["req-1/..", "with space", "café-ü-✓", "x" * MAX_REQUEST_ID_CHARS]:
        assert (
            validate(PB.GenerateRequest(prompt="hi", request_id=request_id), tok, 2048, tok.vocab_size).request_id
            == request_id
        )


def test_stop_strings_have_a_length_limit(embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    at_limit = ["a" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    assert validate(PB.GenerateRequest(prompt="hi", stop=at_limit), tok, 2048, tok.vocab_size).stop == at_limit
    err = _refusal(tok, stop=["ok", "b" * (MAX_STOP_CHARS + 1)])
    assert err.param == "stop"
    assert str(err) == (
        f"stop strings must have at most {MAX_STOP_CHARS} characters; the one at index 1 has {MAX_STOP_CHARS + 1}"
    )
    huge = _refusal(tok, stop=["c" * 200_000] * MAX_STOP_STRINGS)  # what a user sent: 16 of 200 KB
    assert f"at most {MAX_STOP_CHARS} characters" in str(huge)


def test_top_k_minus_one_disables_top_k_as_over_http(embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    for top_k in (-1, 0):
        req = PB.GenerateRequest(prompt="hi", sampling=PB.SamplingParams(top_k=top_k))
        assert validate(req, tok, 2048, tok.vocab_size).sampling.top_k == 0
    assert validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size, {"top_k": -1}).sampling.top_k == 0
    both = _refusal(tok, top_k=-2, max_tokens=0)  # the field order of the message: top_k before max_tokens
    assert str(both) == "top_k must be >= -1 (-1 or 0 disables), got -2; max_tokens must be >= 1, got 0"
    assert both.param == "top_k"
