"""Embedded default model: a small Llama built deterministically and offline.

pdserve uses it when run without ``--model``. The builder writes a standard
Hugging Face folder (see ``REQUIRED_FILES``) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` ``from_pretrained`` load directly.

* Tokenizer: byte-level BPE trained with ``tokenizers`` on the bundled corpus
  ``embedded_corpus.txt``. Specials: ``<|bos|>`` (id 0), ``<|eos|>`` (id 1),
  ``<|pad|>`` (id 2); a template post-processor prepends one BOS. The vocab is
  whatever BPE reaches on the corpus, capped by the preset's ``vocab_size``;
  the model's vocab equals the tokenizer's.
* Weights: float32 from a seeded CPU ``torch.Generator`` via integer ``randint``
  (exact, platform independent) mapped to uniform values of the wanted std;
  transformers' init routine is not used. Embeddings std 1, projections std
  1/sqrt(fan_in), so each layer adds O(1) to the residual stream and outputs
  depend on context; norms are ones; ``lm_head`` std 3/sqrt(hidden) gives
  final logits with std about 3.
* The ``lm_head`` rows of BOS, EOS and PAD are scaled by 0.1, so random
  generations almost never emit them (greedy essentially never stops on EOS;
  bound generations with ``max_new_tokens``).
* Cache: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``, folder
  ``embedded-<preset>-<hash>``; the hash covers the preset fields, builder
  version and corpus. Builds go to a temp folder in the same parent and are
  renamed into place atomically; a process losing the race uses the winner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUILDER_VERSION = 2  # 2: a chat template
CORPUS_PATH = Path(__file__).with_name("embedded_corpus.txt")
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
# A plain role-tagged chat format (the tags are ordinary text to this tokenizer), so that the chat
# endpoint and its tests have a template to render; the weights know nothing of it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
SPECIAL_ROW_SCALE = 0.1
LOGIT_STD = 3.0


@dataclass(frozen=True)
class EmbeddedPreset:
    name: str
    vocab_size: int  # BPE target; the trained vocab may be smaller
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    seed: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, EmbeddedPreset] = {
    "tiny": EmbeddedPreset("tiny", 1024, 128, 384, 4, 4, 2, 2048, seed=1234),
    "llama-80m": EmbeddedPreset("llama-80m", 8192, 768, 2048, 12, 12, 4, 4096, seed=5678),
}
DEFAULT_PRESET = "tiny"
SPEC_PREFIX = "embedded"


def is_embedded_spec(model: str | None) -> bool:
    """True for ``None``, ``"embedded"`` and ``"embedded:<preset>"``."""
    return model is None or model == SPEC_PREFIX or model.startswith(SPEC_PREFIX + ":")


def resolve_embedded(model: str | None, cache_dir: str | Path | None = None) -> Path | None:
    """Folder of the embedded model named by ``model``, or None if not an embedded spec."""
    if not is_embedded_spec(model):
        return None
    preset = model.split(":", 1)[1] if model and ":" in model else DEFAULT_PRESET
    return embedded_model_dir(preset, cache_dir)


def get_preset(name: str) -> EmbeddedPreset:
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown embedded preset {name!r}; valid presets: {valid}") from None


def default_cache_dir() -> Path:
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def preset_key(preset: EmbeddedPreset) -> str:
    """Short hash of the preset fields, builder version and corpus."""
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(preset), sort_keys=True).encode())
    h.update(f"builder={BUILDER_VERSION}".encode())
    h.update(CORPUS_PATH.read_bytes())
    return h.hexdigest()[:12]


def embedded_model_dir(preset: str = DEFAULT_PRESET, cache_dir: str | Path | None = None) -> Path:
    """Return the cached folder for ``preset``, building it first if absent."""
    p = get_preset(preset)
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = parent / f"embedded-{p.name}-{preset_key(p)}"
    if _complete(final):
        return final
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists():  # damaged (e.g. files removed by hand): move aside, rebuild
        junk = Path(tempfile.mkdtemp(prefix=f".junk-{final.name}-", dir=parent))
        with contextlib.suppress(OSError):
            os.rename(final, junk / "old")
        shutil.rmtree(junk, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=parent))
    try:
        build_model_folder(p, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in REQUIRED_FILES)


def build_model_folder(preset: EmbeddedPreset, out: str | Path) -> None:
    """Write the full Hugging Face folder for ``preset`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(preset, out)
    _write_json(out / "config.json", llama_config(preset, vocab))
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    _write_json(out / "generation_config.json", gen)
    from safetensors.torch import save_file

    save_file(build_weights(preset, vocab), str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:  # sorted keys: byte-stable output
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def llama_config(preset: EmbeddedPreset, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "max_position_embeddings": preset.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
    }


def param_count(preset: EmbeddedPreset, vocab_size: int | None = None) -> int:
    """Parameter count of the built model (``vocab_size`` defaults to the target)."""
    v = preset.vocab_size if vocab_size is None else vocab_size
    h, i, d = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q, kv = preset.num_attention_heads * d, preset.num_kv_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return preset.num_layers * per_layer + 2 * v * h + h


def build_tokenizer(preset: EmbeddedPreset, out: Path) -> int:
    """Train the byte-level BPE tokenizer, save it into ``out``; return vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Training is deterministic (ties broken by pair ids), whatever RAYON_NUM_THREADS is.
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    assert tok.token_to_id(bos) == BOS_ID and tok.token_to_id(SPECIAL_TOKENS[EOS_ID]) == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        model_max_length=preset.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(str(out))
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    # Name the class every transformers version knows (v5 maps it to its backend).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    _write_json(cfg_path, {**tok_cfg, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE})
    return tok.get_vocab_size()


def build_weights(preset: EmbeddedPreset, vocab_size: int) -> dict:
    """Seeded float32 weights with Hugging Face Llama tensor names."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(preset.seed)
    h, i, d = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q, kv = preset.num_attention_heads * d, preset.num_kv_heads * d

    def rand(shape: tuple[int, ...], std: float) -> torch.Tensor:
        # Exact integers -> float64 arithmetic (correctly rounded) -> float32,
        # so the values do not depend on SIMD paths of torch's float samplers.
        k = torch.randint(0, 1 << 24, shape, generator=g, dtype=torch.int64).to(torch.float64)
        u = (k + 0.5) / float(1 << 24) * 2.0 - 1.0  # uniform in (-1, 1), std 1/sqrt(3)
        return (u * (std * math.sqrt(3.0))).to(torch.float32).contiguous()

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand((vocab_size, h), 1.0)}
    sh, si = 1.0 / math.sqrt(h), 1.0 / math.sqrt(i)
    for layer in range(preset.num_layers):
        pre = f"model.layers.{layer}."
        w[pre + "self_attn.q_proj.weight"] = rand((q, h), sh)
        w[pre + "self_attn.k_proj.weight"] = rand((kv, h), sh)
        w[pre + "self_attn.v_proj.weight"] = rand((kv, h), sh)
        w[pre + "self_attn.o_proj.weight"] = rand((h, q), 1.0 / math.sqrt(q))
        w[pre + "mlp.gate_proj.weight"] = rand((i, h), sh)
        w[pre + "mlp.up_proj.weight"] = rand((i, h), sh)
        w[pre + "mlp.down_proj.weight"] = rand((h, i), si)
        w[pre + "input_layernorm.weight"] = torch.ones(h)
        w[pre + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    head = rand((vocab_size, h), LOGIT_STD / math.sqrt(h))
    head[[BOS_ID, EOS_ID, PAD_ID]] *= SPECIAL_ROW_SCALE
    w["lm_head.weight"] = head
    return w
