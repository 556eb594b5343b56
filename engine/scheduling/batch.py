"""What the scheduler hands the model runner for one step, and what a finished step did."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduling.sequence import Sequence


@dataclass
class Batch:
    """Sequences of one model step. ``num_query_tokens[i]`` positions of ``seqs[i]`` are computed,
    from its ``num_computed_tokens`` on: a chunk of its prompt (prefill) or its last token (decode).
    ``is_prefill``: some sequence computes more than its last token."""

    seqs: list[Sequence]
    num_query_tokens: list[int]
    is_prefill: bool

    def samples(self, i: int) -> bool:
        """True when ``seqs[i]``'s chunk reaches its last token, so this step samples its next one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_query_tokens[i] == seq.num_tokens

    @property
    def num_decode_rows(self) -> int:
        """Sequences that compute one token after their prompt (decode rows, not prefill chunks)."""
        return sum(1 for s, n in zip(self.seqs, self.num_query_tokens) if s.is_decoding and n == 1)


def batch_shape(batch: Batch) -> tuple[list[tuple[int, int]], int, int]:
    """``(chunks, b, total_context)`` of a scheduled batch, before it runs: each prompt chunk as
    ``(tokens, cached before it)``, the decode rows and the positions they attend to in all (what
    ``planner.step_model.StepModel.batch_s`` takes, and ``LLMEngine.step_trace`` gets)."""
    chunks, b, context = [], 0, 0
    for seq, n in zip(batch.seqs, batch.num_query_tokens):
        if seq.is_decoding and n == 1:
            b += 1
            context += seq.num_computed_tokens + 1
        else:
            chunks.append((n, seq.num_computed_tokens))
    return chunks, b, context


@dataclass
class Completed:
    """What a finished step did to one sequence: ``token`` is None for a prefill chunk that did not
    reach the end of the prompt; ``prefill`` is True for the first token after a prefill."""

    seq: Sequence
    token: int | None
    prefill: bool
