"""The router's one validator: defaults from the model's generation_config.json, as vLLM takes them."""

from __future__ import annotations

import json

from pdserve.engine.text.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2 as PB
from pdserve.router.validation import sampling_defaults, validate


def test_unset_sampling_follows_generation_config(tmp_path, embedded_dir):
    tok = Tokenizer.from_folder(embedded_dir)
    assert sampling_defaults(embedded_dir) == {}  # the embedded model sets none: 1.0 / 1.0 / 0
    plain = validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size)
    assert (plain.sampling.temperature, plain.sampling.top_p, plain.sampling.top_k) == (1.0, 1.0, 0)

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.0, "top_p": 0.5, "top_k": 7, "bos_token_id": 0}))
    defaults = sampling_defaults(tmp_path)
    assert defaults == {"temperature": 0.0, "top_p": 0.5, "top_k": 7}
    unset = validate(PB.GenerateRequest(prompt="hi"), tok, 2048, tok.vocab_size, defaults)
    assert (unset.sampling.temperature, unset.sampling.top_p, unset.sampling.top_k) == (0.0, 0.5, 7)
    assert unset.sampling.seed == 0  # greedy by the model's default: no random seed drawn
    given = validate(PB.GenerateRequest(prompt="hi", sampling=PB.SamplingParams(temperature=0.8, top_k=0)), tok,
                     2048, tok.vocab_size, defaults)
    assert abs(given.sampling.temperature - 0.8) < 1e-6 and given.sampling.top_k == 0 and given.sampling.top_p == 0.5


def test_a_broken_generation_config_gives_no_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot", "top_k": True}))
    assert sampling_defaults(tmp_path) == {}
