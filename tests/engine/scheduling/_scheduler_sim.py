"""A Scheduler with real Sequence and BlockManager objects, and model steps simulated by appending tokens."""

from __future__ import annotations

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.scheduler import Batch, Scheduler
from pdserve.engine.scheduling.sequence import Sequence

NEXT_TOKEN = 7


def make_seq(request_id: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence.new(request_id, list(range(1, prompt_len + 1)), params)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    chunked_prefill: bool = False,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, chunked_prefill)


def step(sched: Scheduler) -> Batch | None:
    """One simulated model step: every sequence that samples gets one token; finished ones leave."""
    batch = sched.schedule()
    if batch is not None:
        sched.complete(batch, [NEXT_TOKEN] * sum(batch.samples(i) for i in range(len(batch.seqs))))
    return batch


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]
