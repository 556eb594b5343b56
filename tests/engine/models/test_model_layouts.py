"""Our Llama-family forward (engine/models/llama.py) against ``transformers`` on tiny random checkpoints.

Every checkpoint is built here by ``transformers`` itself (seeded, float32, safetensors) and borrows
the stories260K tokenizer (vocab 512). For each layout we check that ``LLMEngine.generate`` over one
continuous batch gives the same greedy tokens as ``generate()`` run one prompt at a time, and that
the logits of a prefill (every position) and of a paged decode step match ``transformers``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.engine.models._tiny_models import (
    BASE,
    STORIES,
    TOKENIZER_FILES,
    build_model,
    drop_tensor,
    edit_config,
    engine_logits,
    hf_greedy,
    hf_logits,
    load_hf,
)

pytestmark = pytest.mark.skipif(
    not all((STORIES / name).is_file() for name in TOKENIZER_FILES),
    reason=f"tokenizer folder {STORIES} is absent",
)

transformers = pytest.importorskip("transformers")

from pdserve.engine.config import EngineConfig, ModelConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.params import SamplingParams  # noqa: E402

MAX_TOKENS = 20
PROMPT_LENS = (1, 11, 130)  # 130 > 64, the original context of the scaled-RoPE cases
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: one intra-op thread is fastest and avoids oversubscribing shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _spec(name: str):
    """(model class, config, save_pretrained kwargs) of a named layout."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    specs = {
        # GQA with 4 query heads per KV head, untied lm_head, non-default rope_theta
        "llama_gqa": (
            LlamaForCausalLM,
            LlamaConfig(
                **{**BASE, "num_attention_heads": 8, "num_key_value_heads": 2},
                rope_theta=50000.0,
                tie_word_embeddings=False,
            ),
            {},
        ),
        "llama_tied": (LlamaForCausalLM, LlamaConfig(**BASE, tie_word_embeddings=True), {}),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE, tie_word_embeddings=True, use_sliding_window=False), {}),
        # sharded on purpose: the loader must follow model.safetensors.index.json
        "mistral": (MistralForCausalLM, MistralConfig(**BASE, sliding_window=None), {"max_shard_size": "60KB"}),
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling=dict(LLAMA3)), {}),
        "linear_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
        # head_dim 32 while hidden / heads = 16
        "head_dim": (LlamaForCausalLM, LlamaConfig(**BASE, head_dim=32), {}),
        # q/k/v/o biases in a Llama
        "llama_attn_bias": (LlamaForCausalLM, LlamaConfig(**BASE, attention_bias=True), {}),
        # gate/up/down biases in a Llama
        "llama_mlp_bias": (LlamaForCausalLM, LlamaConfig(**BASE, mlp_bias=True), {}),
    }
    return specs[name]


LAYOUTS = [
    "llama_gqa",
    "llama_tied",
    "qwen2",
    "mistral",
    "llama3_rope",
    "linear_rope",
    "head_dim",
    "llama_attn_bias",
    "llama_mlp_bias",
]
# checkpoints rewritten into the transformers 4 config.json layout (rope_scaling + top-level rope_theta)
LEGACY = ["legacy_llama3_rope", "legacy_linear_rope"]


def _to_legacy(folder: Path) -> None:
    """Move ``rope_parameters`` to the pre-v5 keys: ``rope_scaling`` and a top-level ``rope_theta``."""
    cfg = json.loads((folder / "config.json").read_text())
    params = dict(cfg["rope_parameters"])
    theta = params.pop("rope_theta")
    if params["rope_type"] == "linear":  # the oldest spelling: "type"
        params["type"] = params.pop("rope_type")
    edit_config(folder, rope_parameters=None, rope_scaling=params, rope_theta=theta)


class Case:
    """A built checkpoint with its engine, its transformers model and the reference outputs."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name, self.folder = name, folder
        self.engine = make_engine(folder, block_size=16)
        self.hf = load_hf(folder)
        self.prompts = _prompts()
        self.ref = hf_greedy(self.hf, self.prompts, MAX_TOKENS, self.engine.eos_token_ids)


def make_engine(folder: Path, block_size: int) -> LLMEngine:
    num_blocks = -(-600 // block_size) + 8
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=num_blocks, block_size=block_size))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            if name.startswith("legacy_"):
                model_cls, config, kwargs = _spec(name.removeprefix("legacy_"))
                build_model(folder, model_cls, config, **kwargs)
                _to_legacy(folder)
            else:
                model_cls, config, kwargs = _spec(name)
                build_model(folder, model_cls, config, **kwargs)
            built[name] = Case(name, folder)
        return built[name]

    return get


def _assert_same_tokens(ours: list[list[int]], ref: list[list[int]]) -> None:
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert r, "empty reference"
        assert o[: len(r)] == r, f"prompt {i} ({PROMPT_LENS[i]} tokens): ours {o} != transformers {r}"
        # the engine stops exactly where transformers does (EOS or max_tokens)
        assert len(o) == len(r), f"prompt {i}: {len(o)} tokens vs transformers {len(r)}"


# -- layouts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LAYOUTS + LEGACY)
def test_greedy_batch_matches_transformers(cases, name):
    case = cases(name)
    ours = case.engine.generate(case.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert sum(len(r) for r in case.ref) >= MAX_TOKENS  # the comparison is not vacuous
    _assert_same_tokens(ours, case.ref)


@pytest.mark.parametrize("name", LAYOUTS + LEGACY)
def test_logits_match_transformers(cases, name):
    case = cases(name)
    torch.testing.assert_close(
        case.engine.runner.model.inv_freq, case.hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0
    )
    for prompt in case.prompts:
        ref = hf_logits(case.hf, prompt)
        prefill, decode = engine_logits(case.engine, prompt)
        torch.testing.assert_close(prefill, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode, ref[-1], atol=1e-4, rtol=1e-4)


def test_layout_files_are_what_the_cases_claim(cases):
    """Guards the premises of the cases above (transformers may change what it saves)."""
    from safetensors import safe_open

    def tensor_names(folder: Path) -> set[str]:
        names: set[str] = set()
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                names |= set(st.keys())
        return names

    gqa = ModelConfig.from_folder(cases("llama_gqa").folder)
    assert (gqa.num_heads, gqa.num_kv_heads, gqa.tie_word_embeddings, gqa.rope_theta) == (8, 2, False, 50000.0)
    assert "lm_head.weight" in tensor_names(cases("llama_gqa").folder)

    tied = cases("llama_tied")
    assert ModelConfig.from_folder(tied.folder).tie_word_embeddings
    assert "lm_head.weight" not in tensor_names(tied.folder)

    qwen = cases("qwen2")
    qcfg = ModelConfig.from_folder(qwen.folder)
    assert qcfg.architecture == "Qwen2ForCausalLM" and qcfg.attention_bias and qcfg.tie_word_embeddings
    names = tensor_names(qwen.folder)
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names

    mistral = cases("mistral")
    assert (mistral.folder / "model.safetensors.index.json").is_file()
    assert len(list(mistral.folder.glob("*.safetensors"))) > 1

    hd = ModelConfig.from_folder(cases("head_dim").folder)
    assert hd.head_dim == 32 != hd.hidden_size // hd.num_heads

    for name, kind in [
        ("llama3_rope", "llama3"),
        ("linear_rope", "linear"),
        ("legacy_llama3_rope", "llama3"),
        ("legacy_linear_rope", "linear"),
    ]:
        case = cases(name)
        raw = json.loads((case.folder / "config.json").read_text())
        assert ("rope_parameters" in raw) != name.startswith("legacy_"), raw
        cfg = ModelConfig.from_folder(case.folder)
        assert cfg.rope_scaling is not None
        assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == kind
        # the scaling changes the frequencies (so the 130-token prompt exercises it)
        plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        assert not torch.allclose(case.engine.runner.model.inv_freq, plain)
        assert case.hf.config.rope_parameters["rope_type"] == kind  # transformers read the same file


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


# -- errors ----------------------------------------------------------------------------------------
def _copy(cases, tmp_path: Path, name: str = "llama_gqa") -> Path:
    dst = tmp_path / "model"
    shutil.copytree(cases(name).folder, dst)
    return dst


def test_unsupported_architecture(cases, tmp_path):
    folder = _copy(cases, tmp_path)
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


def test_missing_safetensors(cases, tmp_path):
    folder = _copy(cases, tmp_path)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("llama_gqa", "model.layers.1.mlp.down_proj.weight"),
        ("llama_gqa", "lm_head.weight"),
        ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ],
)
def test_missing_tensor(cases, tmp_path, name, tensor):
    folder = _copy(cases, tmp_path, name)
    drop_tensor(folder, tensor)
    with pytest.raises(KeyError, match=tensor.replace(".", r"\.")):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


@pytest.mark.parametrize(
    "changes, kind",
    [
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0,
                }
            },
            "yarn",
        ),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_unsupported_rope_type(cases, tmp_path, changes, kind):
    folder = _copy(cases, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=kind):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


def test_unsupported_activation(cases, tmp_path):
    """A Llama config with another activation than SiLU must be refused, not run as SiLU."""
    folder = _copy(cases, tmp_path)
    edit_config(folder, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=8))


def test_mistral_sliding_window(tmp_path):
    """Prompts and generations longer than the window: prefill and decode both apply it."""
    from transformers import MistralConfig, MistralForCausalLM

    folder = build_model(tmp_path / "model", MistralForCausalLM, MistralConfig(**BASE, sliding_window=16))
    engine, hf = make_engine(folder, 16), load_hf(folder)
    prompts = _prompts()
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    _assert_same_tokens(ours, hf_greedy(hf, prompts, MAX_TOKENS, engine.eos_token_ids))
