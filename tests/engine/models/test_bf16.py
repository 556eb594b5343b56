"""bfloat16 against transformers in bfloat16, within the stated tolerance.

bf16 keeps 8 bits of mantissa, and our GEMMs, fused projections and attention kernel round in other
places than transformers does, so outputs are not token-identical. What we promise
(docs/architecture.md, "What the tests hold"):

* logits of every position (prefill) and of a paged decode step differ from transformers' by at most
  ``LOGIT_TOL`` times the reference logits' standard deviation (measured worst: 0.04 on the embedded
  model, 0.07 on llama-80m);
* greedy output agrees over all ``MAX_TOKENS`` tokens on at least ``FULL_AGREEMENT`` of the prompts
  (measured: embedded 6/10 to 9/10 as kernels change their summation order, llama-80m 7/10; the
  embedded model's random weights give many near-ties), and where it first differs, the token we
  chose was a near-tie in transformers' own logits: within ``LOGIT_TOL`` standard deviations of its
  maximum. The near-tie rule is the real check; the fraction only guards against every prompt
  drifting.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.text.tokenizer import Tokenizer
from tests.conftest import mixed_prompts
from tests.engine.models._tiny_models import engine_logits, hf_logits

LOGIT_TOL = 0.1
MAX_TOKENS = 16
FULL_AGREEMENT = 0.5


@pytest.fixture(scope="module")
def setup(model_dir):
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_folder(model_dir)
    prompts = [tok.encode(p) for p in mixed_prompts()]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=512))
    return prompts, hf, engine


def test_bf16_logits_within_tolerance(setup):
    prompts, hf, engine = setup
    for p in prompts:
        with torch.inference_mode():
            ref = hf_logits(hf, p)
        prefill, decode = engine_logits(engine, p)
        scale = ref.std().item()
        assert (prefill - ref).abs().max().item() <= LOGIT_TOL * scale
        assert (decode - ref[-1]).abs().max().item() <= LOGIT_TOL * scale


def test_bf16_greedy_agrees_with_transformers(setup):
    prompts, hf, engine = setup
    ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    full = 0
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
        if o == ref:
            full += 1
            continue
        n = next(i for i, (a, b) in enumerate(zip(o, ref)) if a != b)
        with torch.inference_mode():
            logits = hf_logits(hf, p + ref[:n])[-1]
        assert logits.max() - logits[o[n]] <= LOGIT_TOL * logits.std(), f"token {n}: {o[n]} is no near-tie"
    assert full >= FULL_AGREEMENT * len(prompts)
