"""Tokenizer folders shared by the tokenizer and detokenizer tests.

* ``stories_dir``: the real Llama tokenizer of stories260K (BPE + byte fallback,
  Metaspace pre-tokenizer, BOS from the post-processor); skipped when absent.
* ``bytelevel_dir``: a tiny GPT-2 style byte-level BPE trained here on English,
  Chinese and emoji text, saved through ``PreTrainedTokenizerFast``.
* ``make_variant``: a copy of a folder with edited JSON files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import STORIES

TRAIN_TEXTS = [
    "Once upon a time there was a little girl named Lily. She liked to play in the park.",
    "Tom and his dog went to the shop to buy some bread and milk.",
    "今天天气很好，我们去公园玩吧。小猫在睡觉。",
    "我喜欢吃苹果和香蕉。你好，世界！",
    "I love pizza 🍕 and cake 🎂! 😀😃🎉 The end. 👍",
    "Hello, world! 你好 🌍 123 456",
]

SAMPLE_TEXTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "今天天气很好，我们去公园玩吧。",
    "I love pizza 🍕 and cake 🎂! 😀😃🎉 👨‍👩‍👧",
    "Mixed: 你好 world 🌍, naïve café — “quotes” ½",
    "",
    " ",
    "   leading and trailing spaces   ",
    "\n\nnew\tlines\r\n",
    "Once upon a time there was a girl. 她很开心 😀! " * 40,
]


def stories_folder() -> Path:
    """The stories260K folder, or a pytest skip when it is not present."""
    if not (STORIES / "tokenizer.json").is_file():
        pytest.skip(f"{STORIES} is not available")
    return STORIES


def build_bytelevel(folder: Path) -> Path:
    """Train a ~350-token byte-level BPE and save it as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXTS * 4, trainer)
    tok.add_tokens(["<|tool|>"])  # a non-special added token: kept by decode
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", add_bos_token=True)
    hf.save_pretrained(str(folder))
    (folder / "config.json").write_text(
        json.dumps({"max_position_embeddings": 256, "eos_token_id": 1, "bos_token_id": 0})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    return folder


def make_variant(src: Path, dst: Path, **edits: dict) -> Path:
    """Copy the JSON files of ``src`` to ``dst`` and apply ``edits``.

    Each keyword names a file stem (``tokenizer``, ``tokenizer_config``, ``config``,
    ``generation_config``) and maps keys to new values; a value of ``...`` deletes
    the key.
    """
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.glob("*.json"):
        shutil.copy(path, dst / path.name)
    for stem, changes in edits.items():
        path = dst / f"{stem}.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        for key, value in changes.items():
            if value is ...:
                data.pop(key, None)
            else:
                data[key] = value
        path.write_text(json.dumps(data, ensure_ascii=False))
    return dst
