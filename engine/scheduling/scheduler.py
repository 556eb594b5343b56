"""Continuous-batching scheduler: moves sequences between the waiting and running deques and picks
how many tokens of each one a step computes."""

from __future__ import annotations

from collections import deque

from pdserve.engine.scheduling.batch import Batch, Completed
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from pdserve.engine.scheduling.step_time import StepTimeModel

# A waiting sequence that KV blocks keep out for this many consecutive steps makes room by
# preempting the running sequence holding the most blocks (it is recomputed once blocks free up).
PREEMPT_AFTER_STEPS = 8


class Scheduler:
    """Two policies over the same queues.

    * Chunked prefill (the default; vLLM v1's token budget, with bounded waiting): a step has a
      budget of ``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` rows. Decoding
      sequences take one row and one token each, in round robin when more decode than fit;
      sequences still prefilling (FIFO) and then waiting prompts (FIFO) share the rest, the last
      chunk cut to fit. While prefill work is queued, decoding leaves it
      ``max(1, max_num_seqs // 2)`` rows (at most what it asks), and a prefilling sequence leaves
      half the prompt budget to the head of the waiting queue. Admission is bounded by KV blocks,
      not by ``max_num_seqs``: more sequences may run than fit one step, and they take turns.
    * Prefill-first (``chunked_prefill=False``; vLLM's original scheduler, nano-vllm): a step is
      either a prefill of whole waiting prompts (at most ``max_num_batched_tokens`` tokens and
      ``max_num_seqs`` prompts, but always at least one) or one decode step of the running batch.

    **The bound** (chunked): a prompt at the head of the waiting queue, with KV blocks free for
    it, is admitted at the next step and gets at least half the step's prompt budget until its
    first token, whatever else runs: its first token comes within
    ``ceil(uncached_tokens / (budget // 2)) + 1`` steps. When KV blocks keep it out for
    ``PREEMPT_AFTER_STEPS`` steps, the running sequence holding the most blocks is preempted to
    make room (its KV is recomputed later, from its cached prefix); it waits second in line.
    A decoding sequence gets a token at least every ``ceil(num_decoding / decode_rows)`` steps.

    With ``target_step_s`` (chunked prefill only), the budget of a step is the decoding sequences
    plus as many prompt tokens as :class:`StepTimeModel`, fitted online to the steps so far, says
    fit in ``target_step_s`` beside them (at least ``block_size``, at most
    ``max_num_batched_tokens``): every step, and so every inter-token gap of a decoding sequence,
    aims at that time on whatever hardware runs it.

    When KV blocks run short for a running sequence, the most recently admitted other running
    sequence is preempted: its blocks are freed and it waits, at the head of the queue, to be
    recomputed (its prompt and the tokens it produced). With prefix caching a waiting sequence
    starts from the longest cached prefix of its tokens. With a sliding window on every layer,
    each finished step frees the blocks that fell out of the window
    (``BlockManager.free_outside_window``), so a chunked prefill holds about window + chunk positions.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        target_step_s: float | None = None,
    ) -> None:
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
        self._next_turn = 0  # where the next decode rows start when not all decoding fit one step
        self._blocked_steps = 0  # consecutive steps KV blocks kept the head of the waiting queue out
        self.num_prompt_tokens_admitted = 0  # tokens of admitted sequences (recomputes count again)
        self.num_cached_tokens_admitted = 0  # of those, taken from the prefix cache
        self.num_preemptions = 0

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
        if self._blocked_steps >= PREEMPT_AFTER_STEPS and self.waiting:
            self._preempt_for_waiting()
        if self.chunked_prefill:
            self._schedule_chunked(seqs, counts)
        elif not self._schedule_waiting(seqs, counts, self.max_num_batched_tokens, self.max_num_seqs):
            self._schedule_decode(seqs, counts, self.max_num_seqs, None)
        if not seqs:
            return None
        is_prefill = any(not (s.is_decoding and n == 1) for s, n in zip(seqs, counts))
        return Batch(seqs, counts, is_prefill)

    def _schedule_chunked(self, seqs: list[Sequence], counts: list[int]) -> None:
        total, rows = self.step_budget(), self.max_num_seqs
        prefilling = [s for s in self.running if not s.is_decoding]
        reserve = min(len(prefilling) + len(self.waiting), max(1, rows // 2))
        if self._schedule_decode(seqs, counts, rows - reserve, total):
            return
        for seq in prefilling:  # FIFO; the head of the waiting queue keeps half of what is left
            budget = total - sum(counts)
            room = rows - len(seqs) - (1 if self.waiting else 0)
            cap = budget - (budget // 2 if self.waiting else 0)
            if room <= 0 or cap <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted while this batch was built
                continue
            n = min(seq.num_uncomputed_tokens, cap)
            if not self._grow_or_preempt(seq, n, seqs):
                return
            seqs.append(seq)
            counts.append(n)
        self._schedule_waiting(seqs, counts, total - sum(counts), rows)
        if len(seqs) < rows:  # rows kept for prefill work that could not use them go to decoding
            self._schedule_decode(seqs, counts, rows - len(seqs), total - sum(counts))

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

    def _grow_or_preempt(self, seq: Sequence, n: int, seqs: list[Sequence]) -> bool:
        """Give running ``seq`` the blocks for ``n`` more tokens, preempting the most recently
        admitted other running sequences not in this step (or ``seq`` itself, last) until they fit.
        False when ``seq`` was preempted."""
        need = self._positions(seq, n)
        while not self.blocks.can_grow(seq, need):
            victim = next((s for s in reversed(self.running) if s is not seq and s not in seqs), seq)
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, need)
        return True

    def _schedule_decode(self, seqs: list[Sequence], counts: list[int], rows: int, budget: int | None) -> bool:
        """Add decoding sequences not yet in the step (chunked policy; every running one
        otherwise), one token each (chunked) or all they have left, at most ``rows`` of them and
        ``budget`` tokens (None: no budget), taking turns when not all fit. True when a sequence
        was preempted."""
        turn = [s for s in self.running if (s.is_decoding or not self.chunked_prefill) and s not in seqs]
        if budget is not None:
            rows = min(rows, budget)
        if len(turn) > rows:
            start = self._next_turn % len(turn)
            turn = turn[start:] + turn[:start]
        preemptions, taken = self.num_preemptions, 0
        for seq in turn:
            if taken >= rows:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted while this batch was built
                continue
            n = 1 if self.chunked_prefill else seq.num_uncomputed_tokens
            if not self._grow_or_preempt(seq, n, seqs):
                break
            seqs.append(seq)
            counts.append(n)
            taken += 1
        self._next_turn += taken
        return self.num_preemptions != preemptions

    def _schedule_waiting(self, seqs: list[Sequence], counts: list[int], budget: int, rows: int) -> bool:
        """Admit waiting sequences in FIFO order within ``budget`` tokens and ``rows`` rows of the
        step; True when any was. A head that KV blocks keep out for ``PREEMPT_AFTER_STEPS`` steps
        preempts the running sequence holding the most blocks (not one of this step)."""
        admitted = False
        while self.waiting and budget > 0 and len(seqs) < rows:
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
                self._blocked_steps += not admitted
                break
            self._blocked_steps = 0
            self.blocks.grow(seq, need)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.resumed()
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
            admitted = True
            self.num_prompt_tokens_admitted += seq.num_tokens
            self.num_cached_tokens_admitted += cached
        return admitted

    def preempt_for(self, num_blocks: int) -> None:
        """Preempt running sequences, the one holding the most blocks first, until ``num_blocks``
        blocks are free (or nothing runs); they wait first in line, in that order, to be recomputed."""
        victims = []
        while self.blocks.num_free < num_blocks and self.running:
            victim = max(self.running, key=self.blocks.num_held)
            self._preempt(victim)
            victims.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(victims))

    def _preempt_for_waiting(self) -> None:
        """KV blocks kept the head of the waiting queue out for ``PREEMPT_AFTER_STEPS`` steps:
        preempt the running sequence holding the most blocks, which then waits second in line."""
        self._blocked_steps = 0
        victims = [s for s in self.running if self.blocks.num_held(s)]
        if victims:
            victim = max(victims, key=self.blocks.num_held)
            self._preempt(victim)
            self.waiting.remove(victim)
            self.waiting.insert(1, victim)

    def _unmatch(self, seq: Sequence) -> None:
        """Give back the cached prefix a sequence that stays waiting was given."""
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unmatch(seq)
        seq.status = SequenceStatus.WAITING
        seq.preempted()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

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
            self.blocks.free_outside_window(seq)
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
