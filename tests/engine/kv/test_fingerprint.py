"""ModelFingerprint: every field is part of the identity (digest, mismatches), from_dict checks what
a peer sent, and an engine's fingerprint follows what shapes its KV cache or names its weights and
nothing else."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.fingerprint import KvCodecError, ModelFingerprint, layer_layout
from pdserve.engine.llm_engine import LLMEngine

BASE = ModelFingerprint("LlamaForCausalLM", 4, 2, 32, "float32", 16, "a" * 64, "b" * 64)
FIELDS = [f.name for f in dataclasses.fields(ModelFingerprint)]


def changed(fp: ModelFingerprint, name: str) -> ModelFingerprint:
    value = getattr(fp, name)
    return dataclasses.replace(fp, **{name: value + 1 if isinstance(value, int) else value + "x"})


# -- the dataclass ----------------------------------------------------------------------------


def test_equal_fingerprints_agree():
    twin = ModelFingerprint(**BASE.to_dict())
    assert twin == BASE and hash(twin) == hash(BASE)
    assert twin.digest() == BASE.digest()
    assert len(BASE.digest()) == 64 and int(BASE.digest(), 16) >= 0
    assert BASE.mismatches(twin) == []


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_changes_the_digest_and_is_named_in_mismatches(name):
    other = changed(BASE, name)
    assert other != BASE
    assert other.digest() != BASE.digest()
    (line,) = BASE.mismatches(other)
    assert line == f"{name} {getattr(BASE, name)!r} != {getattr(other, name)!r}"


def test_mismatches_lists_each_differing_field():
    other = changed(changed(BASE, "num_layers"), "dtype")
    assert BASE.mismatches(other) == ["num_layers 4 != 5", "dtype 'float32' != 'float32x'"]


def test_the_hashes_default_to_a_placeholder_that_still_counts():
    bare = ModelFingerprint(*dataclasses.astuple(BASE)[:7])
    assert bare.weights_hash == bare.config_hash == bare.layers == "-"
    assert bare.digest() != BASE.digest()


def test_to_dict_and_from_dict_round_trip():
    d = BASE.to_dict()
    assert set(d) == set(FIELDS)
    assert ModelFingerprint.from_dict(d) == BASE
    assert ModelFingerprint.from_dict(json.loads(json.dumps(d))) == BASE


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: ["not", "a", "map"], "not a map"),
        (lambda d: d.pop("head_dim") and d, "missing key 'head_dim'"),
        (lambda d: {**d, "rope_theta": 1.0}, "unknown keys: rope_theta"),
        (lambda d: {**d, "num_layers": 0}, "num_layers must be a positive int"),
        (lambda d: {**d, "num_kv_heads": -2}, "num_kv_heads must be a positive int"),
        (lambda d: {**d, "head_dim": True}, "head_dim must be a positive int"),
        (lambda d: {**d, "block_size": "16"}, "block_size must be a positive int"),
        (lambda d: {**d, "block_size": 16.0}, "block_size must be a positive int"),
        (lambda d: {**d, "dtype": 32}, "dtype must be a str"),
        (lambda d: {**d, "weights_hash": None}, "weights_hash must be a str"),
    ],
)
def test_from_dict_refuses_what_a_peer_cannot_mean(edit, message):
    with pytest.raises(KvCodecError, match=message):
        ModelFingerprint.from_dict(edit(BASE.to_dict()))


def test_the_codec_error_is_a_value_error():
    assert issubclass(KvCodecError, ValueError)


# -- an engine's fingerprint --------------------------------------------------------------------


def engine_fp(model_dir: Path, **cfg) -> ModelFingerprint:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 32, "dtype": "float32", **cfg})).fingerprint


@pytest.fixture(scope="module")
def base_fp(embedded_dir) -> ModelFingerprint:
    return engine_fp(embedded_dir)


@pytest.fixture
def model_copy(embedded_dir, tmp_path, monkeypatch) -> Path:
    """A copy of the embedded model folder to edit (weight hashes cached under tmp_path)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return Path(shutil.copytree(embedded_dir, tmp_path / "model"))


def edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_the_engine_reports_its_model_and_cache_layout(embedded_dir, base_fp):
    cfg = json.loads((embedded_dir / "config.json").read_text())
    assert base_fp.architecture == cfg["architectures"][0]
    assert base_fp.num_layers == cfg["num_hidden_layers"]
    assert base_fp.num_kv_heads == cfg["num_key_value_heads"]
    assert base_fp.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (base_fp.dtype, base_fp.block_size) == ("float32", 16)
    assert len(base_fp.tokenizer_hash) == 64 and len(base_fp.weights_hash) == 64
    assert base_fp.layers == f"{cfg['num_hidden_layers']}x{base_fp.head_dim}/full"


def test_layer_layout_counts_runs_of_equal_layers():
    assert layer_layout([64] * 3, [None] * 3) == "3x64/full"
    assert layer_layout([64, 64, 64, 128], [None, 4096, 4096, None]) == "1x64/full,2x64/w4096,1x128/full"


def test_a_sliding_window_changes_it(base_fp, model_copy):
    edit_config(model_copy, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["architecture", "config_hash", "layers"]
    assert fp.layers == f"{fp.num_layers}x{fp.head_dim}/w64"


@pytest.mark.parametrize(
    "cfg",
    [
        {"num_kv_blocks": 64},
        {"max_num_seqs": 3},
        {"max_num_batched_tokens": 64},
        {"enable_chunked_prefill": False},
        {"enable_prefix_caching": False},
        {"max_model_len": 128},
        {"attention_backend": "torch"},
        {"target_itl_ms": 50.0},
    ],
    ids=lambda cfg: next(iter(cfg)),
)
def test_scheduling_and_cache_size_settings_leave_it_unchanged(embedded_dir, base_fp, cfg):
    fp = engine_fp(embedded_dir, **cfg)
    assert fp == base_fp and fp.digest() == base_fp.digest()


@pytest.mark.parametrize(
    ("cfg", "field"),
    [({"block_size": 8}, "block_size"), ({"dtype": "bfloat16"}, "dtype"), ({"dtype": "float16"}, "dtype")],
)
def test_block_size_and_kv_dtype_change_it(embedded_dir, base_fp, cfg, field):
    fp = engine_fp(embedded_dir, **cfg)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == [field]
    assert fp.digest() != base_fp.digest()


def test_the_same_folder_elsewhere_has_the_same_fingerprint(base_fp, model_copy):
    assert engine_fp(model_copy) == base_fp


def test_other_weights_of_the_same_shapes_change_it(base_fp, model_copy):
    weights = load_file(model_copy / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"][0, 0] += 1.0
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["weights_hash"]


def test_another_tokenizer_file_changes_it(base_fp, model_copy):
    path = model_copy / "tokenizer.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=1))  # same tokenizer, other bytes
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["tokenizer_hash"]


def test_the_same_weights_read_with_other_heads_change_it(base_fp, model_copy):
    """Two heads of 64 instead of four of 32 (one KV head instead of two): the weight files are the
    same bytes, but the KV cache is laid out differently."""
    edit_config(model_copy, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["num_kv_heads", "head_dim", "config_hash", "layers"]
    assert fp.weights_hash == base_fp.weights_hash


def test_the_architecture_changes_it(base_fp, model_copy):
    edit_config(model_copy, architectures=["MistralForCausalLM"], model_type="mistral")
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["architecture", "config_hash"]


def test_fewer_layers_change_it(base_fp, model_copy):
    weights = load_file(model_copy / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith(("model.layers.2.", "model.layers.3."))}
    save_file(kept, model_copy / "model.safetensors", metadata={"format": "pt"})
    edit_config(model_copy, num_hidden_layers=2)
    fp = engine_fp(model_copy)
    assert [m.split()[0] for m in base_fp.mismatches(fp)] == ["num_layers", "weights_hash", "config_hash", "layers"]


@pytest.mark.parametrize(
    "edit", [{"rope_theta": 500000.0}, {"rms_norm_eps": 1e-3}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}]
)
def test_the_same_weights_under_another_config_change_it(base_fp, model_copy, edit):
    """Keys are cached after RoPE and normed inputs: another base, scaling or epsilon computes
    other KV from the same weights, which a decode worker must refuse."""
    edit_config(model_copy, **edit)
    assert [m.split()[0] for m in base_fp.mismatches(engine_fp(model_copy))] == ["config_hash"]


def test_how_the_config_was_written_does_not_change_it(base_fp, model_copy):
    edit_config(model_copy, transformers_version="0.0.1", _name_or_path="/elsewhere")
    assert engine_fp(model_copy) == base_fp
