"""Find a model folder (embedded, local Hugging Face folder, or hub id) and load its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.embedded import resolve_embedded
from pdserve.engine.models.gguf import GEMMA3, SMOLLM2, resolve_gguf
from pdserve.engine.models.registry import family_module

_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


def resolve_model_dir(model: str | None) -> Path:
    """Local folder for a model spec.

    ``None`` / ``"embedded"`` / ``"embedded:<preset>"``: the embedded model, built on first use.
    ``"smollm2-135m"``, ``"gemma3-270m"`` or a ``*.gguf`` file: converted once into a cached folder
    (``gguf.py``).
    An existing folder: used as is. Anything else: a Hugging Face hub id, downloaded with
    ``huggingface_hub.snapshot_download`` (needs network). Raises FileNotFoundError with a
    readable message when the spec is neither a folder nor a downloadable hub id.
    """
    embedded = resolve_embedded(model)
    if embedded is not None:
        return embedded
    converted = resolve_gguf(model)
    if converted is not None:
        return converted
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model {model!r} is not a folder and not a Hugging Face hub id (owner/name); the built-in names are "
            f"embedded, embedded:<preset>, {SMOLLM2} and {GEMMA3}, and a path to a *.gguf file is read too"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=_HUB_FILES))
    except Exception as exc:  # network, auth or missing repo: one readable message
        raise FileNotFoundError(f"could not download model {model!r} from the Hugging Face hub: {exc}") from exc


def weights_hash(folder: Path, cache_dir: str | Path | None = None) -> str:
    """sha256 hex over the folder's weight files (names and bytes, in name order), computed once
    per file set: cached under ``$PDSERVE_CACHE_DIR/weights-hash`` by path, size and mtime (model
    folders may be read-only). Safe for workers that start side by side: the cached digest is
    written atomically and a malformed one is recomputed."""
    import hashlib
    import os
    import threading

    from pdserve.engine.models.embedded import default_cache_dir

    files = sorted(Path(folder).glob("*.safetensors"))
    key = hashlib.sha256(repr([(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode())
    cached = Path(cache_dir or default_cache_dir()) / "weights-hash" / key.hexdigest()[:32]
    if cached.is_file():
        text = cached.read_text().strip()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            return text
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    digest = h.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, cached)  # atomic: a worker starting beside this one never reads a half-written digest
    except OSError:
        pass  # a read-only cache only costs the next start the hashing
    return digest


# config.json keys that say how a file was written, not what the model computes
CONFIG_KEYS_NOT_HASHED = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"})


def config_hash(folder: Path) -> str:
    """sha256 hex of the folder's config.json as canonical JSON (sorted keys), without
    ``CONFIG_KEYS_NOT_HASHED``: two folders with the same weights but another RoPE base or scaling,
    norm epsilon or activation compute other KV. "-" when the folder has no config.json."""
    import hashlib

    path = Path(folder) / "config.json"
    if not path.is_file():
        return "-"
    cfg = {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k not in CONFIG_KEYS_NOT_HASHED}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()


def load_weights(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Read every safetensors shard in ``folder`` into ``{hf_name: tensor}`` on ``device``.

    Raises FileNotFoundError when there are no safetensors files and KeyError naming the first
    missing tensor.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    module = family_module(cfg.architecture)
    rename = getattr(module, "checkpoint_name", _decoder_tensor)  # the family's names, None: not needed
    for name in files:
        with safe_open(str(folder / name), "pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118  (a safetensors file is not iterable)
                if (ours := rename(key)) is not None:
                    weights[ours] = f.get_tensor(key).to(device=device, dtype=dtype)
    if hasattr(module, "normalize"):  # another checkpoint layout of the same tensors
        module.normalize(weights, cfg)
    for key in module.tensor_names(cfg):
        if key not in weights:
            raise KeyError(f"weights in {folder} lack tensor {key!r}")
    return weights


def _decoder_tensor(key: str) -> str | None:
    """A decoder's tensors keep their names; any other (a vision tower's, say) is not loaded."""
    return key if key.startswith("model.") or key == "lm_head.weight" else None


def required_tensor_names(cfg: ModelConfig) -> list[str]:
    """Hugging Face names of the tensors the forward pass of ``cfg``'s family needs."""
    return family_module(cfg.architecture).tensor_names(cfg)
