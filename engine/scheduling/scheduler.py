"""Continuous-batching scheduler: moves sequences between the waiting and running deques and picks
how many tokens of each one a step computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.scheduling.step_time import StepTimeModel


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


@dataclass
class Completed:
    """What a finished step did to one sequence: ``token`` is None for a prefill chunk that did not
    reach the end of the prompt; ``prefill`` is True for the first token after a prefill."""

    seq: Sequence
    token: int | None
    prefill: bool


class Scheduler:
    """Two policies over the same queues.

    * Chunked prefill (vLLM v1's rule, the default): a step has a budget of
      ``max_num_batched_tokens`` tokens. It first serves the running sequences, in admission order
      (round robin when more run than ``max_num_seqs``): one token for each decoding sequence,
      the next chunk for each one still prefilling; then it admits waiting prompts in FIFO order,
      cutting the last one to fit the budget. Prefill chunks and decode tokens share one step, so
      a long prompt stalls decoding by at most one budgeted step.
    * Prefill-first (``chunked_prefill=False``; vLLM's original scheduler, nano-vllm): a step is
      either a prefill of whole waiting prompts (at most ``max_num_batched_tokens`` tokens, but
      always at least one prompt) or one decode step of the running batch.

    With ``target_step_s`` (chunked prefill only), the budget of a step is the decoding sequences
    plus as many prompt tokens as :class:`StepTimeModel`, fitted online to the steps so far, says
    fit in ``target_step_s`` beside them (at least ``block_size``, at most
    ``max_num_batched_tokens``): every step, and so every inter-token gap of a decoding sequence,
    aims at that time on whatever hardware runs it.

    A step never holds more than ``max_num_seqs`` sequences. When KV blocks run short, the most
    recently admitted running sequence is preempted: its blocks are freed and it waits, at the head
    of the queue, to be recomputed (its prompt and the tokens it produced). With prefix caching a
    waiting sequence starts from the longest cached prefix of its tokens.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, target_step_s: float | None = None) -> None:
        if target_step_s is not None and not target_step_s > 0:
            raise ValueError(f"target_step_s must be > 0, got {target_step_s}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.target_step_s = target_step_s if chunked_prefill else None
        self.step_time = StepTimeModel()  # fed by the engine after every step (observe_step) with a target
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in admission order
        self._next_turn = 0  # where the next step starts when not all running fit one step
        self.num_prompt_tokens_admitted = 0   # tokens of admitted sequences (recomputes count again)
        self.num_cached_tokens_admitted = 0   # of those, taken from the prefix cache

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill."""
        self.waiting.append(seq)

    def admit_running(self, seq: Sequence) -> None:
        """Add a sequence whose KV is already in its blocks (decode worker admission)."""
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = seq.num_tokens - 1
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """Pick the next batch, or None when nothing can run."""
        seqs: list[Sequence] = []
        counts: list[int] = []
        if self.chunked_prefill:
            budget, preempted = self._schedule_running(seqs, counts, self.step_budget())
            if not preempted:
                self._schedule_waiting(seqs, counts, budget)
        elif not self._schedule_waiting(seqs, counts, self.max_num_batched_tokens):
            self._schedule_running(seqs, counts, None)
        if not seqs:
            return None
        is_prefill = any(not (s.is_decoding and n == 1) for s, n in zip(seqs, counts))
        return Batch(seqs, counts, is_prefill)

    def step_budget(self) -> int:
        """The token budget of the next chunked step: ``max_num_batched_tokens``, or with
        ``target_step_s``, the decoding sequences plus the prompt tokens the step-time model says
        fit the target beside them (at least one block, at most the cap)."""
        cap = self.max_num_batched_tokens
        if self.target_step_s is None:
            return cap
        decoding = sum(1 for s in self.running if s.is_decoding)
        prompt = self.step_time.prompt_tokens_within(self.target_step_s, decoding)
        return min(cap, decoding + max(prompt, self.blocks.block_size))

    def observe_step(self, batch: Batch, seconds: float) -> None:
        """Feed a finished step's time to the step-time model; a no-op without ``target_step_s``."""
        if self.target_step_s is None:
            return
        decode = batch.num_decode_rows
        self.step_time.observe(decode, sum(batch.num_query_tokens) - decode, seconds)

    @staticmethod
    def _positions(seq: Sequence, n: int) -> int:
        """KV positions ``seq`` must hold to compute ``n`` more; a chunk that ends a prefill also
        reserves the slot of the token it samples, which the next step writes."""
        end = seq.num_computed_tokens + n
        return end + 1 if end == seq.num_tokens and not seq.is_decoding else end

    def _schedule_running(self, seqs: list[Sequence], counts: list[int], budget: int | None) -> tuple[int, bool]:
        """Add running sequences to the step within ``budget`` tokens (None: one token each, no
        budget). Returns the budget left and whether a sequence was preempted."""
        n_run = len(self.running)
        if n_run == 0:
            return budget or 0, False
        start = self._next_turn % n_run if n_run > self.max_num_seqs else 0
        turn = list(self.running)
        turn = turn[start:] + turn[:start]
        preempted = False
        taken = 0
        for seq in turn:
            if len(seqs) == self.max_num_seqs or budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted while this batch was built
                continue
            n = seq.num_uncomputed_tokens if budget is None else min(seq.num_uncomputed_tokens, budget)
            need = self._positions(seq, n)
            while not self.blocks.can_grow(seq, need):
                victim = next((s for s in reversed(self.running) if s is not seq and s not in seqs), seq)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.grow(seq, need)
            seqs.append(seq)
            counts.append(n)
            taken += 1
            if budget is not None:
                budget -= n
        self._next_turn = start + taken
        return budget or 0, preempted

    def _schedule_waiting(self, seqs: list[Sequence], counts: list[int], budget: int) -> bool:
        """Admit waiting sequences in FIFO order within ``budget`` tokens; True when any was."""
        admitted = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            n = seq.num_uncomputed_tokens
            if self.chunked_prefill:
                n = min(n, budget)
            elif admitted and n > budget:
                self._unmatch(seq)
                break
            need = self._positions(seq, n)
            if not self.blocks.can_grow(seq, need):
                self._unmatch(seq)
                break
            self.blocks.grow(seq, need)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            admitted = True
            self.num_prompt_tokens_admitted += seq.num_tokens
            self.num_cached_tokens_admitted += cached
        return admitted

    def _unmatch(self, seq: Sequence) -> None:
        """Give back the cached prefix a sequence that stays waiting was given."""
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unmatch(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def complete(self, batch: Batch, tokens: list[int]) -> list[Completed]:
        """Record a finished step: each sequence's chunk is computed (its full blocks enter the
        prefix cache), and the sequences that sampled take ``tokens`` (one per sampling sequence,
        in batch order). Sequences that finish leave the queues and free their blocks."""
        out: list[Completed] = []
        it = iter(tokens)
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            prefill = samples and not seq.is_decoding
            seq.num_computed_tokens += batch.num_query_tokens[i]
            self.blocks.cache_full_blocks(seq, seq.num_computed_tokens)
            token = next(it) if samples else None
            if token is not None:
                seq.append_token(token)
                if seq.is_finished:
                    self.finish(seq)
            out.append(Completed(seq, token, prefill))
        return out

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
