"""Batch invariance, observed: the logits an engine computes for one position, either through
decode steps or through one prefill (``benchmarks/migration_divergence.py`` and the tests)."""

from __future__ import annotations

import torch

import pdserve.engine.model_runner as runner_module
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams


def logits_after(engine: LLMEngine, prompt: list[int], produced: list[int]) -> torch.Tensor:
    """The logits ``[vocab_size]`` (the engine's dtype) for the position after ``prompt +
    produced``: the prompt is prefilled, then ``produced`` is fed to the sampler one decode step
    at a time (as an undisturbed stream computes it); with ``produced`` empty, one prefill of
    ``prompt`` computes it (as a migrated or preempted stream does). Not thread-safe: it swaps
    the engine's sampler and logits function for the duration of one ``generate``."""
    captured, forced = {}, iter(produced)
    compute, sample = engine.runner.model.compute_logits, runner_module.sample

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        captured["logits"] = out = compute(hidden)
        return out

    def forcing(logits, *args, **kwargs):
        out = sample(logits, *args, **kwargs)
        nxt = next(forced, None)
        return out if nxt is None else [nxt] * len(out)

    engine.runner.model.compute_logits, runner_module.sample = spy, forcing
    try:
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(produced) + 1, ignore_eos=True))
    finally:
        engine.runner.model.compute_logits, runner_module.sample = compute, sample
    return captured["logits"][-1]
