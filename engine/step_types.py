"""What an engine step hands back, and the errors of the step API (``pdserve.engine.llm_engine``)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduling.sequence import Sequence


class KvCacheFullError(RuntimeError):
    """The paged KV cache has too few free blocks for a request right now (retry later)."""


class StepError(RuntimeError):
    """A model step failed; ``seqs`` were finished with ERROR and freed."""

    def __init__(self, cause: Exception, seqs: list[Sequence]) -> None:
        super().__init__(f"model step failed: {cause!r}")
        self.seqs = seqs


@dataclass
class StepOutput:
    """A token sampled for ``seq`` in one step. ``prefill`` is True for the first token after a prefill."""

    seq: Sequence
    token: int
    prefill: bool
