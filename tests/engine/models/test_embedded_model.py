"""Tests for the embedded default model builder (engine/models/embedded.py)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine.models import embedded
from pdserve.engine.models.embedded import (
    DEFAULT_PRESET,
    PRESETS,
    embedded_model_dir,
    is_embedded_spec,
    param_count,
    resolve_embedded,
)
from tests.conftest import REPO

SAMPLES = [
    "hi",
    "Hello, world! The cat sat on the mat , and then ... it left.",
    "今天天气很好，我们去公园散步吧。",
    "量子纠缠让鬣狗和麒麟都很惊讶。",
    "Emoji test 😊🎉 ☀️ ❤️ done",
    "def f(x):\n    return x * 2  # tabs\tand  double  spaces\n",
    "Mixed: 价格 ¥120, total=$17.88 (50% off) — ok?",
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return embedded_model_dir("tiny", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_dir)
    m.eval()
    return m


def test_folder_layout_and_config(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert names == set(embedded.REQUIRED_FILES)
    assert tiny_dir.name.startswith("embedded-tiny-")
    cfg = json.loads((tiny_dir / "config.json").read_text())
    preset = PRESETS["tiny"]
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["pad_token_id"] is None
    assert cfg["hidden_size"] == preset.hidden_size
    assert cfg["num_key_value_heads"] == preset.num_kv_heads < cfg["num_attention_heads"]
    assert cfg["head_dim"] == preset.hidden_size // preset.num_attention_heads
    assert 512 <= cfg["vocab_size"] <= preset.vocab_size
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg["bos_token_id"] and gen["eos_token_id"] == cfg["eos_token_id"]


def test_build_is_deterministic_across_processes(tiny_dir, tmp_path):
    # Second build in a fresh process with single-threaded torch/rayon.
    env = dict(os.environ, RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    code = (
        "import sys; from pdserve.engine.models.embedded import embedded_model_dir as f; print(f('tiny', sys.argv[1]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, check=True, capture_output=True, text=True
    )
    other = Path(out.stdout.strip().splitlines()[-1])
    assert other.name == tiny_dir.name
    assert _digests(other) == _digests(tiny_dir)
    assert len(_digests(tiny_dir)) == len(embedded.REQUIRED_FILES)


def test_weights_are_pinned():
    # Guards against RNG drift across torch versions / machines.
    w = embedded.build_weights(PRESETS["tiny"], 1024)
    emb = w["model.embed_tokens.weight"]
    assert emb.dtype == torch.float32 and emb.shape == (1024, 128)
    assert abs(emb.double().std().item() - 1.0) < 0.02
    assert hashlib.sha256(emb.numpy().tobytes()).hexdigest()[:16] == PINNED_EMBED_SHA


PINNED_EMBED_SHA = "454737928cb98391"


def test_weights_names_and_special_rows(tiny_dir):
    from safetensors.torch import load_file

    w = load_file(str(tiny_dir / "model.safetensors"))
    n = PRESETS["tiny"].num_layers
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(n):
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ):
            expected.add(f"model.layers.{i}.{part}.weight")
    assert set(w) == expected
    assert all(t.dtype == torch.float32 for t in w.values())
    assert torch.equal(w["model.norm.weight"], torch.ones(PRESETS["tiny"].hidden_size))
    norms = w["lm_head.weight"].norm(dim=1)
    typical = norms[3:].median()
    assert norms[embedded.EOS_ID] < 0.2 * typical
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert sum(t.numel() for t in w.values()) == param_count(PRESETS["tiny"], cfg["vocab_size"])


def test_forward_is_healthy_and_generate_runs(model, tokenizer):
    enc = tokenizer("The library on Elm Street is quiet. 今天早上下了一点小雨。", return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    logits = out.logits[0]
    assert torch.isfinite(logits).all()
    std = logits.std(dim=-1)
    assert ((std > 1.5) & (std < 5.0)).all(), std
    for h in out.hidden_states:
        rms = h.pow(2).mean().sqrt().item()
        assert 0.5 < rms < 10.0
    # EOS is strongly disfavoured.
    assert (logits.argmax(-1) != tokenizer.eos_token_id).all()
    # The prediction depends on context, not only on the last token.
    a = tokenizer("I like green apples", return_tensors="pt")["input_ids"]
    b = tokenizer("Our dog ate the apples", return_tensors="pt")["input_ids"]
    assert a[0, -1] == b[0, -1]
    with torch.no_grad():
        la, lb = model(a).logits[0, -1], model(b).logits[0, -1]
    assert not torch.allclose(la, lb, atol=0.5)

    gen = model.generate(**enc, max_new_tokens=20, do_sample=False)
    assert gen.shape[1] == enc["input_ids"].shape[1] + 20
    again = model.generate(**enc, max_new_tokens=20, do_sample=False)
    assert torch.equal(gen, again)


def test_tokenizer_roundtrip_bos_and_multibyte(tokenizer):
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.bos_token_id == embedded.BOS_ID
    assert tokenizer.eos_token == "<|eos|>" and tokenizer.eos_token_id == embedded.EOS_ID
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == embedded.PAD_ID
    assert tokenizer.model_max_length == PRESETS["tiny"].max_position_embeddings
    ids = tokenizer("hi")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert set(tokenizer("hi")) == {"input_ids", "attention_mask"}
    for text in SAMPLES:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text
    # Byte-level: some Chinese character is split across several tokens in context ...
    ids = tokenizer(SAMPLES[3], add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    assert len(ids) > 3
    # ... and on its own.
    assert any(len(tokenizer(ch, add_special_tokens=False)["input_ids"]) > 1 for ch in SAMPLES[3])


def test_unknown_preset_and_specs(tmp_path, tiny_dir, monkeypatch):
    with pytest.raises(ValueError) as exc:
        embedded_model_dir("nope", tmp_path)
    for name in PRESETS:
        assert name in str(exc.value)
    assert DEFAULT_PRESET == "tiny" and {"tiny", "llama-80m"} <= set(PRESETS)

    assert is_embedded_spec(None)
    assert is_embedded_spec("embedded")
    assert is_embedded_spec("embedded:tiny")
    assert is_embedded_spec("embedded:llama-80m")
    assert not is_embedded_spec("meta-llama/Llama-3.2-1B")
    assert not is_embedded_spec("/models/embedded")
    assert not is_embedded_spec("embeddedx")

    assert resolve_embedded("meta-llama/Llama-3.2-1B", tmp_path) is None
    assert resolve_embedded("/some/local/folder") is None
    cache = tiny_dir.parent
    assert resolve_embedded(None, cache) == tiny_dir
    assert resolve_embedded("embedded", cache) == tiny_dir
    assert resolve_embedded("embedded:tiny", cache) == tiny_dir
    with pytest.raises(ValueError, match="llama-80m"):
        resolve_embedded("embedded:bogus", tmp_path)

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    assert embedded_model_dir() == tiny_dir
    assert resolve_embedded(None) == tiny_dir


def test_damaged_folder_is_rebuilt(tmp_path, tiny_dir):
    first = embedded_model_dir("tiny", tmp_path)
    (first / "model.safetensors").unlink()
    second = embedded_model_dir("tiny", tmp_path)
    assert second == first and _digests(second) == _digests(tiny_dir)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


RACE_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from pdserve.engine.models import embedded
    cache, go = sys.argv[1], Path(sys.argv[2])
    real = embedded.build_model_folder
    def traced(*a, **k):
        real(*a, **k)
        print("built", flush=True)
    embedded.build_model_folder = traced
    while not go.exists():
        time.sleep(0.005)
    print(embedded.embedded_model_dir("tiny", cache), flush=True)
    """
)


def test_concurrent_build_race(tmp_path, tiny_dir):
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_CHILD, str(cache), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(0.5)
    cache.mkdir()
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.strip().splitlines() for out, _ in outs]
    paths = {Path(ls[-1]) for ls in lines}
    assert len(paths) == 1
    (folder,) = paths
    assert all("built" in ls for ls in lines), lines  # both really raced to build
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temp leftovers
    assert _digests(folder) == _digests(tiny_dir)


def test_llama_80m(tmp_path):
    preset = PRESETS["llama-80m"]
    assert 75e6 < param_count(preset) < 95e6
    start = time.monotonic()
    folder = embedded_model_dir("llama-80m", tmp_path)
    elapsed = time.monotonic() - start
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 12 and cfg["hidden_size"] == 768
    assert cfg["num_key_value_heads"] == 4 and cfg["max_position_embeddings"] == 4096
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
            total += math.prod(f.get_slice(name).get_shape())
    assert total == param_count(preset, cfg["vocab_size"])
    assert 70e6 < total < 95e6
    assert elapsed < 120, elapsed
