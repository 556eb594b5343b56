"""Phi-3 and LongRoPE: what the tiny checkpoints of _layout_cases.py claim, and which factor set each
uses. Their greedy tokens and logits are compared with transformers' in test_model_layouts.py."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.engine.models._layout_cases import (
    MAX_TOKENS,
    NEEDS_TOKENIZER,
    _assert_same_tokens,
    checkpoint_tensor_names,
    longrope,
    make_engine,
)

pytestmark = [NEEDS_TOKENIZER, pytest.mark.usefixtures("_one_thread")]  # _one_thread: see conftest.py

transformers = pytest.importorskip("transformers")

from pdserve.engine.config import ModelConfig  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402


def _inv_freq(factors: list[float], dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors) * base ** (torch.arange(0, dim, 2).float() / dim))


def test_phi3_files_are_what_the_cases_claim(cases):
    folder = cases("phi3").folder
    names = checkpoint_tensor_names(folder)
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    cfg = ModelConfig.from_folder(folder)
    assert (cfg.architecture, cfg.layer_windows, cfg.rope_scaling) == ("Phi3ForCausalLM", (48, 48), None)
    assert cfg.partial_rotary_factor == 1.0 and not cfg.tie_word_embeddings


def test_longrope_factor_sets(cases):
    """Long factors where the checkpoint serves past its original context, short ones elsewhere;
    the attention factor from ``factor``, or max_position_embeddings / original without it."""
    long = cases("phi3_longrope")
    cfg = ModelConfig.from_folder(long.folder)
    assert (cfg.partial_rotary_factor, cfg.max_position_embeddings) == (0.75, 256)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64
    model = long.engine.runner.model
    torch.testing.assert_close(model.inv_freq, _inv_freq(longrope(6, 64)["long_factor"], 12))
    assert model.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))

    short = cases("phi3_longrope_short").engine.runner.model
    torch.testing.assert_close(short.inv_freq, _inv_freq(longrope(8, 256)["short_factor"], 16))
    assert short.attention_scaling == 1.0

    llama = cases("llama_longrope").engine.runner.model  # explicit factor 4
    torch.testing.assert_close(llama.inv_freq, _inv_freq(longrope(8, 256)["short_factor"], 16))
    assert llama.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))

    legacy = ModelConfig.from_folder(cases("legacy_phi3_longrope").folder)
    assert legacy.rope_scaling["rope_type"] == "longrope" and legacy.partial_rotary_factor == 0.75


def test_longrope_limitation_is_where_transformers_switches(cases):
    """The documented difference: within the original 64 positions transformers uses the short
    factors of the long-context checkpoint, which we do not (engine/models/rope.py)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    case = cases("phi3_longrope")
    hf_short, _ = ROPE_INIT_FUNCTIONS["longrope"](case.hf.config, None, seq_len=64)
    hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](case.hf.config, None, seq_len=65)
    ours = case.engine.runner.model.inv_freq
    torch.testing.assert_close(ours, hf_long)
    assert not torch.allclose(ours, hf_short)


def test_split_projection_checkpoint_gives_the_same_tokens(cases, tmp_path):
    """The same Phi-3 weights under Llama's separate q/k/v and gate/up names load as they are."""
    from safetensors.torch import load_file, save_file

    case = cases("phi3")
    folder = Path(shutil.copytree(case.folder, tmp_path / "split"))
    cfg = ModelConfig.from_folder(folder)
    w = load_file(str(folder / "model.safetensors"))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        parts = w.pop(attn + "qkv_proj.weight").split((q, kv, kv))
        w.update({f"{attn}{x}_proj.weight": t.contiguous() for x, t in zip("qkv", parts)})
        gate, up = w.pop(mlp + "gate_up_proj.weight").chunk(2)
        w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"] = gate.contiguous(), up.contiguous()
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours = make_engine(folder, 16).generate(case.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, case.ref)
