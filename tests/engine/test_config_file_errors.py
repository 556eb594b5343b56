"""config.json problems a user meets get one clear ValueError, not a KeyError or a wrong guess."""

from __future__ import annotations

import pytest

from pdserve.engine.config import ModelConfig


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"architectures": "LlamaForCausalLM"}, "'architectures' must be a list of names"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "lacks 'num_attention_heads'"),
        ({"model_type": "llama", "hidden_size": 64}, "lacks 'num_attention_heads', which a LlamaForCausalLM"),
        ({"model_type": "qwen3", "hidden_size": 64}, "which a Qwen3ForCausalLM model needs"),
        ({"model_type": "gpt2", "n_embd": 64}, "names no 'architectures' and a model_type, 'gpt2', not one of"),
        ({"hidden_size": 64}, "names no 'architectures' and no model_type; add"),
        ({"architectures": [7]}, "'architectures' must be a list of names"),
    ],
)
def test_a_bad_config_gets_one_clear_error(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_a_config_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        ModelConfig.from_folder(tmp_path)
