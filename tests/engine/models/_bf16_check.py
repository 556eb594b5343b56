"""The bfloat16 promise, checked against transformers in bfloat16 (test_bf16.py, test_family_bf16.py).

bf16 keeps 8 bits of mantissa, and our GEMMs, fused projections and attention kernel round in other
places than transformers does, so outputs are not token-identical. What we promise
(docs/architecture.md, "What the tests hold"):

* logits of every position (prefill) and of a paged decode step differ from transformers' by at most
  ``LOGIT_TOL`` times the reference logits' standard deviation;
* greedy output agrees over all its tokens on at least ``FULL_AGREEMENT`` of the prompts, and where
  it first differs, the token we chose was a near-tie in transformers' own logits: within
  ``LOGIT_TOL`` standard deviations of its maximum. The near-tie rule is the real check; the
  fraction only guards against every prompt drifting.
"""

from __future__ import annotations

import torch

from tests.engine.models._tiny_models import engine_logits, hf_greedy, hf_logits

LOGIT_TOL = 0.1
FULL_AGREEMENT = 0.5


def assert_logits_close(engine, hf, prompts: list[list[int]]) -> None:
    """Prefill logits of every position and one paged decode step's, within ``LOGIT_TOL`` std."""
    for p in prompts:
        with torch.inference_mode():
            ref = hf_logits(hf, p)
        prefill, decode = engine_logits(engine, p)
        scale = ref.std().item()
        assert (prefill - ref).abs().max().item() <= LOGIT_TOL * scale, f"prompt of {len(p)}: prefill logits"
        assert (decode - ref[-1]).abs().max().item() <= LOGIT_TOL * scale, f"prompt of {len(p)}: decode logits"


def assert_greedy_agrees(hf, prompts: list[list[int]], ours: list[list[int]], max_tokens: int) -> None:
    """``ours`` (greedy, ``max_tokens`` each) against ``hf.generate``: the near-tie rule at the first
    difference, and whole agreement on ``FULL_AGREEMENT`` of the prompts."""
    full = 0
    for p, o in zip(prompts, ours, strict=True):
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        ref = out[0, len(p) :].tolist()
        if o == ref:
            full += 1
            continue
        n = next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), None)
        if n is None:  # one stopped early (EOS) where the other went on: compare the next token
            n = min(len(o), len(ref))
            if n >= len(o):
                continue
        with torch.inference_mode():
            logits = hf_logits(hf, p + ref[:n])[-1]
        assert logits.max() - logits[o[n]] <= LOGIT_TOL * logits.std(), f"token {n}: {o[n]} is no near-tie"
    assert full >= FULL_AGREEMENT * len(prompts), f"only {full} of {len(prompts)} prompts agree in full"


# Tiny random checkpoints (initializer_range 0.2, MoE routers) lose more to bf16 than real models:
# transformers' own bf16 logits stray up to 1.6 std from its float32 ones on them (a flipped expert).
# There the promise is relative: our bf16 is no further from float32 than ``BF16_FACTOR`` times
# transformers' bf16 (measured worst ratio 1.4), or within ``LOGIT_TOL`` std.
BF16_FACTOR = 1.5


def _budget(hf32, hf16, tokens: list[int]) -> tuple[torch.Tensor, float]:
    """float32 reference logits of ``tokens`` and the error budget in units of their std."""
    with torch.inference_mode():
        ref, bf16 = hf_logits(hf32, tokens), hf_logits(hf16, tokens)
    scale = ref.std().item()
    return ref, max(LOGIT_TOL, BF16_FACTOR * (bf16 - ref).abs().max().item() / scale)


def assert_close_to_float32(engine, hf32, hf16, prompts: list[list[int]], max_tokens: int) -> None:
    """``engine`` (bf16) against transformers in float32 (``hf32``), each prompt within the budget
    ``_budget`` draws from transformers in bf16 (``hf16``): prefill and paged decode logits, and
    greedy output, where it first leaves float32's, picking a token within the budget of the maximum."""
    from pdserve.engine.params import SamplingParams

    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    refs = hf_greedy(hf32, prompts, max_tokens, engine.eos_token_ids)
    for p, o, r in zip(prompts, ours, refs, strict=True):
        ref, budget = _budget(hf32, hf16, p)
        prefill, decode = engine_logits(engine, p)
        scale = ref.std().item()
        assert (prefill - ref).abs().max().item() <= budget * scale, f"prompt of {len(p)}: prefill logits"
        assert (decode - ref[-1]).abs().max().item() <= budget * scale, f"prompt of {len(p)}: decode logits"
        n = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
        if n is None:
            assert len(o) == len(r), f"prompt of {len(p)}: {len(o)} tokens vs {len(r)}"
            continue
        logits, budget = _budget(hf32, hf16, p + r[:n])
        gap = (logits[-1].max() - logits[-1][o[n]]).item()
        assert gap <= budget * logits[-1].std().item(), f"prompt of {len(p)}, token {n}: {o[n]} is no near-tie"
