"""Our Llama-family forward (engine/models/llama.py) against ``transformers`` on tiny random checkpoints.

Every checkpoint is built here by ``transformers`` itself (seeded, float32, safetensors) and borrows
the stories260K tokenizer (vocab 512). For each layout we check that ``LLMEngine.generate`` over one
continuous batch gives the same greedy tokens as ``generate()`` run one prompt at a time, and that
the logits of a prefill (every position) and of a paged decode step match ``transformers``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.engine.models._layout_cases import (
    LAYOUTS,
    LEGACY,
    MAX_TOKENS,
    NEEDS_TOKENIZER,
    _assert_same_tokens,
    _prompts,
    checkpoint_tensor_names,
    make_engine,
)
from tests.engine.models._tiny_models import BASE, build_model, engine_logits, hf_greedy, hf_logits, load_hf

pytestmark = [NEEDS_TOKENIZER, pytest.mark.usefixtures("_one_thread")]  # _one_thread: see conftest.py

transformers = pytest.importorskip("transformers")

from pdserve.engine.config import ModelConfig  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS + LEGACY)
def test_greedy_batch_matches_transformers(cases, name):
    case = cases(name)
    ours = case.engine.generate(case.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert sum(len(r) for r in case.ref) >= MAX_TOKENS  # the comparison is not vacuous
    _assert_same_tokens(ours, case.ref)


def _hf_rope(hf) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor; for LongRoPE those of the longest
    sequence the checkpoint takes (its buffer holds those of the last forward)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = hf.model.rotary_emb
    if rope.rope_type == "longrope":
        inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=hf.config.max_position_embeddings)
        return inv_freq, rope.attention_scaling
    return rope.inv_freq.float(), rope.attention_scaling


@pytest.mark.parametrize("name", LAYOUTS + LEGACY)
def test_logits_match_transformers(cases, name):
    case = cases(name)
    inv_freq, attention_scaling = _hf_rope(case.hf)
    torch.testing.assert_close(case.engine.runner.model.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert case.engine.runner.model.attention_scaling == pytest.approx(attention_scaling, rel=1e-12)
    for prompt in case.prompts:
        ref = hf_logits(case.hf, prompt)
        prefill, decode = engine_logits(case.engine, prompt)
        torch.testing.assert_close(prefill, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode, ref[-1], atol=1e-4, rtol=1e-4)


def test_layout_files_are_what_the_cases_claim(cases):
    """Guards the premises of the cases above (transformers may change what it saves)."""
    gqa = ModelConfig.from_folder(cases("llama_gqa").folder)
    assert (gqa.num_heads, gqa.num_kv_heads, gqa.tie_word_embeddings, gqa.rope_theta) == (8, 2, False, 50000.0)
    assert "lm_head.weight" in checkpoint_tensor_names(cases("llama_gqa").folder)

    tied = cases("llama_tied")
    assert ModelConfig.from_folder(tied.folder).tie_word_embeddings
    assert "lm_head.weight" not in checkpoint_tensor_names(tied.folder)

    qwen = cases("qwen2")
    qcfg = ModelConfig.from_folder(qwen.folder)
    assert qcfg.architecture == "Qwen2ForCausalLM" and qcfg.attention_bias and qcfg.tie_word_embeddings
    names = checkpoint_tensor_names(qwen.folder)
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names

    mistral = cases("mistral")
    assert (mistral.folder / "model.safetensors.index.json").is_file()
    assert len(list(mistral.folder.glob("*.safetensors"))) > 1

    hd = ModelConfig.from_folder(cases("head_dim").folder)
    assert hd.head_dim == 32 != hd.hidden_size // hd.num_heads

    for name, kind in [
        ("llama3_rope", "llama3"),
        ("mistral_llama3", "llama3"),
        ("linear_rope", "linear"),
        ("qwen3_linear", "linear"),
        ("legacy_llama3_rope", "llama3"),
        ("legacy_linear_rope", "linear"),
        ("yarn_rope", "yarn"),
        ("qwen2_yarn", "yarn"),
        ("legacy_yarn_rope", "yarn"),
        ("llama_longrope", "longrope"),
        ("phi3_longrope", "longrope"),
        ("phi3_longrope_short", "longrope"),
        ("legacy_phi3_longrope", "longrope"),
    ]:
        case = cases(name)
        raw = json.loads((case.folder / "config.json").read_text())
        assert ("rope_parameters" in raw) != name.startswith("legacy_"), raw
        cfg = ModelConfig.from_folder(case.folder)
        assert cfg.rope_scaling is not None
        assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == kind
        # the scaling changes the frequencies (so the 130-token prompt exercises it)
        dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        assert not torch.allclose(case.engine.runner.model.inv_freq, plain)
        assert case.hf.config.rope_parameters["rope_type"] == kind  # transformers read the same file

    yarn = cases("yarn_rope").engine.runner.model
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert cases("yarn_rope").hf.model.rotary_emb.attention_scaling == pytest.approx(yarn.attention_scaling)


def test_family_files_are_what_the_cases_claim(cases):
    q3 = ModelConfig.from_folder(cases("qwen3").folder)
    assert (q3.architecture, q3.qk_norm, q3.head_dim, q3.attention_bias) == ("Qwen3ForCausalLM", True, 32, False)
    assert q3.layer_windows == (None, None) and q3.moe_layers == ()
    window = ModelConfig.from_folder(cases("qwen3_window").folder)
    assert window.layer_windows == (None, 16, 16) and window.sliding_window == 16
    moe = ModelConfig.from_folder(cases("qwen3_moe").folder)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 48)
    assert moe.moe_layers == (0, 2) and not moe.norm_topk_prob and moe.qk_norm
    norm = ModelConfig.from_folder(cases("qwen3_moe_norm").folder)
    assert norm.moe_layers == (1,) and norm.norm_topk_prob and norm.num_experts_per_tok == 3
    mixtral = ModelConfig.from_folder(cases("mixtral").folder)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_layers) == (4, 2, (0, 1))
    assert mixtral.norm_topk_prob and not mixtral.qk_norm


@pytest.mark.parametrize(
    ("name", "moe", "proj"),
    [
        ("qwen3_moe", "mlp.", ("gate_proj", "up_proj", "down_proj")),
        ("mixtral", "block_sparse_moe.", ("w1", "w3", "w2")),
    ],
)
def test_stacked_expert_checkpoints_give_the_same_tokens(cases, tmp_path, name, moe, proj):
    """The same weights saved as transformers 5 holds them in memory: ``mlp.gate`` and each layer's
    experts stacked into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    import shutil

    from safetensors.torch import load_file, save_file

    case = cases(name)
    folder = Path(shutil.copytree(case.folder, tmp_path / name))
    w = load_file(str(folder / "model.safetensors"))
    cfg = ModelConfig.from_folder(folder)
    for i in cfg.moe_layers:
        old, new = f"model.layers.{i}.{moe}", f"model.layers.{i}.mlp."
        names = [[f"{old}experts.{e}.{x}.weight" for x in proj] for e in range(cfg.num_experts)]
        w[new + "gate.weight"] = w.pop(old + "gate.weight")
        w[new + "experts.gate_up_proj"] = torch.stack([torch.cat((w.pop(g), w.pop(u))) for g, u, _ in names])
        w[new + "experts.down_proj"] = torch.stack([w.pop(d) for _, _, d in names])
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    engine = make_engine(folder, 16)
    ours = engine.generate(case.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, case.ref)


# -- paging ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_size_does_not_change_tokens(cases, block_size):
    case = cases("llama_gqa")
    engine = make_engine(case.folder, block_size)
    ours = engine.generate(case.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, case.ref)
    for prompt in case.prompts[1:]:
        ref = hf_logits(case.hf, prompt)[-1]
        _, decode = engine_logits(engine, prompt)
        torch.testing.assert_close(decode, ref, atol=1e-4, rtol=1e-4)


def test_mistral_sliding_window(tmp_path):
    """Prompts and generations longer than the window: prefill and decode both apply it."""
    from transformers import MistralConfig, MistralForCausalLM

    folder = build_model(tmp_path / "model", MistralForCausalLM, MistralConfig(**BASE, sliding_window=16))
    engine, hf = make_engine(folder, 16), load_hf(folder)
    prompts = _prompts()
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, hf_greedy(hf, prompts, MAX_TOKENS, engine.eos_token_ids))
