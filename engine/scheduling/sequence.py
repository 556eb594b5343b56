"""A request's state inside an engine: tokens, KV block table, status, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, or preempted and to be recomputed)
    RUNNING = "running"  # KV present; in the decode batch
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS token
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # cancelled
    ERROR = "error"


@dataclass
class Sequence:
    """One request. ``token_ids`` = prompt followed by generated tokens.

    ``num_computed_tokens`` positions have their KV in the cache (a prefix taken from the prefix
    cache counts, ``num_cached_tokens`` of them); a step computes the next ones, a chunk of the
    prompt or, once only the last token is left (``is_decoding``), that token. ``block_tables``
    holds one table per KV cache group (``kv_groups``; one for most models), each listing the KV
    block ids covering positions 0.. in order; ``block_table`` is the first. ``block_hashes`` names
    its first full blocks (prefix caching, see ``prefix_hash``).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    prefill_start_ns: int = 0
    prefill_end_ns: int = 0
    num_preemptions: int = 0  # times its KV was freed to be recomputed
    preempted_ns: int = 0  # nanoseconds spent waiting to be recomputed, all preemptions together
    _preempted_at_ns: int = 0

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> Sequence:
        """A waiting sequence for a prompt; ValueError for an empty prompt."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        return cls(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, eos_token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's block table (the only one of a model that is not hybrid)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Positions still to compute before the next token can be sampled (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return len(self.token_ids) - self.num_computed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int) -> None:
        """Add a sampled token and finish the sequence on EOS or max_tokens."""
        self.token_ids.append(token)
        if not self.sampling.ignore_eos and token in self.eos_token_ids:
            self.finish(FinishReason.STOP)
        elif self.num_output_tokens >= self.sampling.max_tokens:
            self.finish(FinishReason.LENGTH)

    def preempted(self) -> None:
        """Its KV was freed: it waits to be recomputed (the wait is counted in ``preempted_ns``)."""
        self.num_preemptions += 1
        self._preempted_at_ns = time.monotonic_ns()

    def resumed(self) -> None:
        """It left the waiting queue for the running batch."""
        if self._preempted_at_ns:
            self.preempted_ns += time.monotonic_ns() - self._preempted_at_ns
            self._preempted_at_ns = 0

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
