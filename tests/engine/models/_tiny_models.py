"""Tiny random Llama-family checkpoints built with ``transformers`` itself, and HF reference outputs.

* ``STORIES``: the stories260K folder whose tokenizer (vocab 512) the tiny models borrow.
* ``build_model``: save a seeded random ``XForCausalLM`` plus the tokenizer files into a folder.
* ``hf_greedy`` / ``hf_logits``: the ``transformers`` reference (float32, one prompt at a time).
* ``engine_logits``: last-position logits of our forward, via a prefill and via a paged decode.
* ``edit_config`` / ``drop_tensor``: corrupt a saved folder for the error-path tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import STORIES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 512

# Shared shape of every tiny model: small enough that the whole file runs in seconds.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def build_model(folder: Path, model_cls, config, seed: int = 0, **save_kwargs) -> Path:
    """Save a seeded random ``model_cls(config)`` in float32 (safetensors) plus the tokenizer files.

    Biases and norm weights are re-drawn too (transformers initialises them to 0 and 1), so a
    forward that skipped or swapped them would not match the reference.
    """
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(STORIES / name, folder / name)
    return folder


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    """Greedy continuation of each prompt, run alone (no padding)."""
    eos = sorted(eos_ids)
    outs = []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.int64)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


@torch.inference_mode()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt), vocab] of one prompt."""
    ids = torch.tensor([prompt], dtype=torch.int64)
    return model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()


def prefill_metadata(slots: torch.Tensor, table: list[int], n: int):
    """Metadata of a one-sequence prefill of ``n`` tokens at ``slots`` in blocks ``table``."""
    from pdserve.engine.models.attention import AttentionMetadata

    return AttentionMetadata(
        True,
        slots,
        torch.tensor([table], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.tensor([0, n], dtype=torch.int32),
        cu_seqlens=[0, n],
    )


def engine_logits(engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits for ``prompt`` straight from the model runner's forward (the engine holds no sequences).

    Returns (prefill logits for every position [n, vocab], decode logits of the last position [vocab]).
    The decode value comes from a prefill of ``prompt[:-1]`` into deliberately scattered, reversed KV
    blocks followed by one paged decode step of the last token.
    """
    from pdserve.engine.models.attention import AttentionMetadata

    runner = engine.runner
    model, cache, bs = runner.model, runner.kv_cache, engine.cfg.block_size
    groups, layer_caches = runner.kv_groups, runner.layer_caches

    def per_layer(make):  # one metadata per KV cache group, each layer given its group's
        metas = [make(g) for g in range(groups.num_groups)]
        return metas[0] if len(metas) == 1 else [metas[g] for g in groups.group_of]

    n = len(prompt)
    nblocks = -(-n // bs)
    ids = torch.tensor(prompt, dtype=torch.int64)
    pos = torch.arange(n)
    meta = per_layer(lambda g: prefill_metadata(pos + g * nblocks * bs, [g * nblocks + i for i in range(nblocks)], n))
    prefill = model.compute_logits(model.forward(ids, pos, meta, layer_caches)).float()
    cache.zero_()
    assert 2 * nblocks * groups.num_groups <= runner.num_blocks, "test engine needs more KV blocks"
    tables = [
        [runner.num_blocks - 1 - 2 * i - 2 * nblocks * g for i in range(nblocks)] for g in range(groups.num_groups)
    ]
    slots = [torch.tensor(t)[pos // bs] * bs + pos % bs for t in tables]
    decode = prefill[-1]
    if n > 1:
        model.forward(
            ids[:-1], pos[:-1], per_layer(lambda g: prefill_metadata(slots[g][:-1], tables[g], n - 1)), layer_caches
        )
        meta = per_layer(
            lambda g: AttentionMetadata(
                False,
                slots[g][-1:],
                torch.tensor([tables[g]], dtype=torch.int32),
                torch.tensor([n], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
            )
        )
        decode = model.compute_logits(model.forward(ids[-1:], pos[-1:], meta, layer_caches))[0].float()
    cache.zero_()
    return prefill, decode


def edit_config(folder: Path, **changes) -> None:
    """Rewrite ``folder/config.json`` with ``changes`` (a value of None deletes the key)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg, indent=2))


def drop_tensor(folder: Path, name: str) -> None:
    """Remove one tensor from ``folder/model.safetensors``."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


def prefill_payloads(prefill, prompts: list[list[int]], sampling) -> list:
    """Prefill ``prompts`` (request ids ``r0``, ``r1`` ..) on engine ``prefill`` and take each out
    with ``extract_kv`` as its prefill ends; asserts the engine holds no block afterwards."""
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, sampling)
    payloads = []
    while prefill.has_work():
        payloads += [prefill.extract_kv(o.seq) for o in prefill.step() if o.prefill]
    assert prefill.blocks.num_used == 0
    return payloads
