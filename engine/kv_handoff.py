"""The KV hand-off half of the engine: what a prefill worker takes out and a decode worker puts in.

A prefill worker takes each prefilled sequence out with ``extract_kv`` (the whole KV at once) or
streams it layer by layer from the model runner's layer hook; a decode worker holds the cached
prefix of a coming KV (``pin_prefix``) and places it with ``admit_kv`` (a whole payload) or
``reserve_kv`` + its layers written + ``admit_reserved`` (a layer-wise stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.engine.kv.codec import KvPayload
from pdserve.engine.kv.layer_frames import KvStreamHead
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.block_manager import NULL_BLOCK
from pdserve.engine.scheduling.prefix_hash import prefix_hashes
from pdserve.engine.scheduling.sequence import FinishReason, Sequence
from pdserve.engine.step_types import KvCacheFullError


class KvHandoff:
    """Mixed into ``LLMEngine``: uses its ``cfg``, ``blocks``, ``scheduler``, ``runner``,
    ``fingerprint``, ``eos_token_ids``, ``check_request`` and ``_pinned`` (request id -> the prefix
    held for its coming KV). Drive it from the engine's thread, as the engine."""

    def pin_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Hold the longest cached prefix of ``token_ids`` for a KV payload yet to come, so that its
        sender can leave those positions out (``KvPayload.kv_start``). Returns its length in tokens
        (0 without prefix caching or a cached prefix); ``unpin`` or ``reserve_kv`` releases it."""
        self.unpin(request_id)
        seq = Sequence.new(request_id, token_ids, SamplingParams(), self.eos_token_ids)
        cached = self.blocks.match_prefix(seq)
        if cached:
            self._pinned[request_id] = seq
        return cached

    def unpin(self, request_id: str) -> None:
        """Release a prefix held by ``pin_prefix`` (no-op when none is)."""
        seq = self._pinned.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    def admit_kv(self, payload: KvPayload, preempt: bool = False) -> Sequence:
        """Place a prefilled sequence (prompt KV + first token) into the running batch: ``reserve_kv``
        (errors as there), ``payload.kv`` [num_layers, 2, num_prompt_tokens - kv_start,
        num_kv_heads, head_dim] written into its blocks, ``admit_reserved``."""
        seq = self.reserve_kv(payload, preempt)
        try:
            self.runner.write_kv(seq, payload.kv, payload.kv_start)
            return self.admit_reserved(seq, payload.first_token)
        except Exception:  # nothing runs it: its blocks go back
            self.release_kv(seq)
            raise

    def reserve_kv(self, payload: KvPayload | KvStreamHead, preempt: bool = False) -> Sequence:
        """Blocks for a prefilled sequence whose KV is yet to be written: ``payload``'s request id,
        prompt (``token_ids``), ``sampling``, ``kv_start`` and ``prefix_hashes`` (its KV and first
        token are not read). Returns the sequence, its table covering the prompt and the first token,
        outside the scheduler: the caller writes positions ``kv_start ..`` into its blocks, then
        ``admit_reserved`` runs it or ``release_kv`` frees it.

        With ``kv_start`` > 0 the positions before it come from the prefix ``pin_prefix`` held or, on a
        model with a sliding window on every layer, lie before the window of the first decode query
        (``BlockManager.window_start``) and are never needed: their table entries are ``NULL_BLOCK``.
        Raises ValueError when the request can never fit or the prefix held for it is not the
        payload's, and KvCacheFullError when blocks are short now (the prefix stays held for a
        retry), unless ``preempt``: then running sequences holding the most blocks are preempted
        (recomputed here later) until it fits. Sequences waiting here to be recomputed or
        prefilled go first: while any waits, a payload is admitted only by ``preempt``.
        """
        sampling = SamplingParams.from_dict(payload.sampling)
        self.check_request(payload.token_ids, sampling)
        rid, k, bs = payload.request_id, payload.kv_start, self.cfg.block_size
        kb = k // bs
        held = self._pinned.get(rid)
        dropped = 0 < k <= self.blocks.window_start(len(payload.token_ids))
        if dropped and list(payload.prefix_hashes) != prefix_hashes(payload.token_ids[:k], bs):
            raise ValueError(f"request {rid}: the prefix hashes of its KV do not match its tokens")
        if (
            k
            and not dropped
            and (
                held is None
                or held.token_ids[:k] != list(payload.token_ids[:k])
                or held.block_hashes[:kb] != list(payload.prefix_hashes)
                or any(len(t) < kb for t in held.block_tables)
            )
        ):
            raise ValueError(
                f"request {rid}: its KV starts at position {k}, but this worker holds no such prefix for it"
            )
        seq = Sequence.new(rid, payload.token_ids, sampling, self.eos_token_ids)
        # the prompt and the first token, in every KV cache group; a window group's from its window on
        n, bm = seq.num_tokens, self.blocks
        need = sum(bm.blocks_for(n + 1) - max(kb, bm.group_window_start(g, n) // bs) for g in range(bm.num_groups))
        if preempt:
            self.scheduler.preempt_for(need)
        if need > self.blocks.num_free or (self.scheduler.waiting and not preempt):
            raise KvCacheFullError(
                f"{self.blocks.num_free} free KV blocks and {len(self.scheduler.waiting)} "
                f"sequences waiting for some; request {rid} needs {need}"
            )
        if dropped:  # positions before k are outside the window: no block for them
            self.unpin(rid)
            seq.block_tables = [[NULL_BLOCK] * kb for _ in range(self.blocks.num_groups)]
            seq.block_hashes = list(payload.prefix_hashes)
        elif k:  # the held blocks pass to the sequence; any held past the payload's prefix are let go
            del self._pinned[rid]
            seq.block_tables = [t[:kb] for t in held.block_tables]
            held.block_tables = [t[kb:] for t in held.block_tables]
            seq.block_hashes = held.block_hashes[:kb]
            self.blocks.free(held)
            seq.num_cached_tokens = k
        else:
            self.unpin(rid)
        bm.skip_outside_window(seq, n)  # the first decode query, at position n, reads only its window
        bm.grow(seq, n + 1)
        return seq

    def admit_reserved(self, seq: Sequence, first_token: int) -> Sequence:
        """Run a sequence ``reserve_kv`` placed, whose KV is now in its blocks: ``first_token`` is the
        token its prefill sampled, the next decode step's input. Its arrival becomes now: decode
        time counts from here, as for a sequence ``admit_kv`` placed, not from the reservation."""
        seq.arrival_ns = time.monotonic_ns()
        seq.token_ids.append(first_token)
        self.scheduler.admit_running(seq)
        self.blocks.cache_full_blocks(seq, seq.num_computed_tokens)
        self.blocks.free_outside_window(seq)
        return seq

    def release_kv(self, seq: Sequence) -> None:
        """Let go of a sequence ``reserve_kv`` placed whose stream broke off: its blocks are freed, and
        when ``admit_reserved`` already ran it, it is aborted (idempotent)."""
        self.scheduler.finish(seq, FinishReason.ABORT)

    def extract_kv(
        self, seq: Sequence, alloc: Callable[[int], torch.Tensor] | None = None, skip_tokens: int = 0
    ) -> KvPayload:
        """Take a just-prefilled sequence out of the engine: its KV (all positions but the last
        token; only from ``skip_tokens`` on, rounded down to whole blocks, when the receiver holds
        the positions before, and only from ``BlockManager.window_start`` on when every layer has a
        sliding window) and the last token as ``first_token``. Frees its blocks. ``alloc``:
        see ``ModelRunner.read_kv``."""
        n, bs = seq.num_tokens - 1, self.cfg.block_size
        start = min(max(skip_tokens, self.blocks.window_start(n)), n - 1) // bs * bs
        kv = self.runner.read_kv(seq, n, alloc, start)
        payload = KvPayload(
            seq.request_id,
            self.fingerprint,
            seq.token_ids[:-1],
            seq.token_ids[-1],
            seq.sampling.to_dict(),
            kv,
            kv_start=start,
            prefix_hashes=prefix_hashes(seq.token_ids[:start], bs),
        )
        self.scheduler.finish(seq)
        return payload
