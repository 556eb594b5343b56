"""The batched sampler: greedy, temperature, top-k, top-p, per-request seed."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.engine.models.kernels import argmax_rows
from pdserve.engine.params import SamplingParams, step_seed


def sample(logits: torch.Tensor, params: Seq[SamplingParams], steps: Seq[int]) -> list[int]:
    """Sample one token per row.

    logits: [num_seqs, vocab_size] (any float dtype; computed in float32).
    params[i], steps[i]: the sampling parameters and output-token index of row i.
    Returns the token ids, one per row. Greedy rows take the argmax; the others draw from the
    temperature-scaled, top-k / top-p filtered distribution with a generator seeded by
    ``step_seed(seed, step)``, so a row's draw does not depend on the other rows.
    """
    # the first index of each row's maximum, as argmax gives it: pdserve's kernel for bfloat16 CPU
    # logits, else torch's max without a float32 copy (its reduction is 4x faster than argmax's on a
    # 262,144-token vocabulary here)
    tokens = argmax_rows(logits)
    if tokens is None:
        tokens = logits.max(dim=-1).indices.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = (cum - sorted_probs) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(step_seed(p.seed, steps[i]))
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
