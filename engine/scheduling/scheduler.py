"""Continuous-batching scheduler: moves sequences between the waiting and running deques."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class Batch:
    """Sequences of one model step. Prefill: every token of each sequence is computed; decode: one."""

    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    """Prefill-first scheduling (as in vLLM's original scheduler and nano-vllm).

    Each step is either a prefill batch of waiting sequences (packed, no padding, at most
    ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences, each with its blocks allocated)
    or one decode step of the running batch. When decode runs out of KV blocks, the most recently
    admitted running sequence is preempted: its blocks are freed and it waits to be recomputed.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in admission order
        self._next_turn = 0  # where the next decode step starts when not all running fit one step

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill."""
        self.waiting.append(seq)

    def admit_running(self, seq: Sequence) -> None:
        """Add a sequence whose KV is already in its blocks (decode worker admission)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Pick the next batch, or None when nothing can run."""
        prefill = self._schedule_prefill()
        if prefill:
            return Batch(prefill, is_prefill=True)
        decode = self._schedule_decode()
        return Batch(decode, is_prefill=False) if decode else None

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(batch) + len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if batch and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            # the prefill also needs room for the sampled token's KV at the next decode step
            if not self.blocks.can_allocate(seq.num_tokens + 1):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_tokens + 1)
            seq.status = SequenceStatus.RUNNING
            batch.append(seq)
            tokens += seq.num_tokens
        self.running.extend(batch)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        """Up to ``max_num_seqs`` running sequences, each with room for its next token's KV.

        With more running sequences than that (a decode worker admits every KV it is sent), steps
        take them in turns, round robin from where the last step stopped, so every one advances and
        none starves. When blocks run short, the most recently admitted sequence not yet in this
        step's batch is preempted (or the current one, when it is that sequence)."""
        n = len(self.running)
        if n == 0:
            return []
        start = self._next_turn % n if n > self.max_num_seqs else 0
        turn = list(self.running)
        turn = turn[start:] + turn[:start]
        batch: list[Sequence] = []
        for seq in turn:
            if len(batch) == self.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted while this batch was built
                continue
            while not self.blocks.can_grow(seq, seq.num_tokens):
                victim = next((s for s in reversed(self.running) if s is not seq and s not in batch), seq)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.grow(seq, seq.num_tokens)
            batch.append(seq)
        self._next_turn = start + len(batch)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """Remove a sequence from the queues and free its blocks (idempotent)."""
        if reason is not None and not seq.is_finished:
            seq.finish(reason)
        for queue in (self.waiting, self.running):
            try:
                queue.remove(seq)
            except ValueError:
                pass
        self.blocks.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    return seq
        return None
