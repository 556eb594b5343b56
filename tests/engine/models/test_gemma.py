"""Gemma 2 and Gemma 3 (engine/models/families/gemma.py) against ``transformers`` on tiny random
checkpoints (tests/engine/models/_gemma_cases.py): greedy tokens of one continuous batch equal
``generate()`` run one prompt at a time, 32 tokens each, on both attention backends; the logits of a
prefill and of a paged decode step match; the config reads as transformers reads it."""

from __future__ import annotations

import pytest
import torch

from tests.engine.models._gemma_cases import GEMMA, GLOBAL_ROPE, LOCAL_THETA, TYPES, build_gemma
from tests.engine.models._layout_cases import NEEDS_TOKENIZER
from tests.engine.models._tiny_models import BASE, engine_logits, hf_greedy, hf_logits, load_hf

pytestmark = [NEEDS_TOKENIZER, pytest.mark.usefixtures("_one_thread")]  # _one_thread: see conftest.py
transformers = pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig, ModelConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402

MAX_TOKENS = 32
PROMPT_LENS = (1, 11, 40, 130)  # all but the first two are longer than the window of 16


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4321)
    return [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _engine(folder, backend: str = "auto", block_size: int = 16) -> LLMEngine:
    blocks = -(-600 // block_size) + 8
    cfg = EngineConfig(
        model=str(folder), dtype="float32", num_kv_blocks=blocks, block_size=block_size, attention_backend=backend
    )
    return LLMEngine(cfg)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """name -> (folder, transformers model, its greedy tokens for ``_prompts()``), built once."""
    built: dict = {}

    def get(name: str):
        if name not in built:
            folder = build_gemma(tmp_path_factory.mktemp(name), name)
            hf = load_hf(folder)
            eos = _engine(folder, "torch").eos_token_ids
            built[name] = folder, hf, hf_greedy(hf, _prompts(), MAX_TOKENS, eos)
        return built[name]

    return get


@pytest.mark.parametrize("backend", ["cpu-paged", "torch"])
@pytest.mark.parametrize("name", GEMMA)
def test_greedy_batch_matches_transformers(gemma, name, backend):
    folder, _, ref = gemma(name)
    ours = _engine(folder, backend).generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert sum(len(r) for r in ref) >= 2 * MAX_TOKENS  # the comparison is not vacuous
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o == r, f"{name} prompt {i} ({PROMPT_LENS[i]} tokens): ours {o} != transformers {r}"


@pytest.mark.parametrize("name", GEMMA)
def test_logits_match_transformers(gemma, name):
    folder, hf, _ = gemma(name)
    for backend, block_size in [("cpu-paged", 16), ("torch", 3)]:
        engine = _engine(folder, backend, block_size)
        for prompt in _prompts()[1:]:
            ref = hf_logits(hf, prompt)
            prefill, decode = engine_logits(engine, prompt)
            torch.testing.assert_close(prefill, ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(decode, ref[-1], atol=1e-4, rtol=1e-4)


def test_configs_read_as_transformers_reads_them(gemma):
    g2 = ModelConfig.from_folder(gemma("gemma2")[0])
    assert (g2.architecture, g2.hidden_act, g2.qk_norm, g2.head_dim) == (
        "Gemma2ForCausalLM",
        "gelu_pytorch_tanh",
        False,
        16,
    )
    assert g2.layer_windows == (16, None, 16) and g2.local_rope_theta is None
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (5.0, 10.0)
    assert g2.attention_scale == pytest.approx(24**-0.5) and g2.tie_word_embeddings
    for name in ("gemma3", "gemma3_legacy", "gemma3_multimodal"):
        folder, hf, _ = gemma(name)
        g3 = ModelConfig.from_folder(folder)
        assert g3.qk_norm and g3.attn_logit_softcapping is None, name
        # transformers' Gemma3ForConditionalGeneration does not apply its text model's final soft-cap
        assert g3.final_logit_softcapping == (None if name == "gemma3_multimodal" else 10.0), name
        assert g3.layer_windows == (16, None, 16) and g3.local_rope_theta == LOCAL_THETA, name
        assert (g3.rope_theta, g3.rope_scaling["factor"]) == (GLOBAL_ROPE["rope_theta"], GLOBAL_ROPE["factor"]), name
        text = hf.config.get_text_config()
        assert text.layer_types == TYPES and text.rope_parameters["sliding_attention"]["rope_theta"] == LOCAL_THETA
        model = _engine(folder, "torch").runner.model
        rotary = hf.model.language_model.rotary_emb if name == "gemma3_multimodal" else hf.model.rotary_emb
        torch.testing.assert_close(model.local_inv_freq, rotary.sliding_attention_inv_freq, rtol=1e-6, atol=0)
        torch.testing.assert_close(model.inv_freq, rotary.full_attention_inv_freq, rtol=1e-6, atol=0)
    assert ModelConfig.from_folder(gemma("gemma3_multimodal")[0]).architecture == "Gemma3ForConditionalGeneration"


def test_soft_caps_are_exercised(gemma):
    """Logits beyond the final cap, and the attention cap changes transformers' own logits, so a
    forward that skipped either could not match."""
    _, hf, _ = gemma("gemma2")
    prompt = _prompts()[3]
    with torch.inference_mode():
        assert hf.lm_head(hf.model(torch.tensor([prompt])).last_hidden_state).abs().max() > 10.0
    capped = hf_logits(hf, prompt)
    layers = [layer.self_attn for layer in hf.model.layers]
    try:
        for attn in layers:
            attn.attn_logit_softcapping = None
        assert (hf_logits(hf, prompt) - capped).abs().max() > 1e-2
    finally:
        for attn in layers:
            attn.attn_logit_softcapping = 5.0


def test_unsupported_gemma_settings_are_refused(gemma):
    import json

    raw = json.loads((gemma("gemma3")[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ModelConfig.from_dict({**raw, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_dict({**raw, "use_bidirectional_attention": True})
    sliding = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}
    with pytest.raises(ValueError, match="sliding-window layers"):
        ModelConfig.from_dict({**raw, "rope_parameters": {**raw["rope_parameters"], "sliding_attention": sliding}})
