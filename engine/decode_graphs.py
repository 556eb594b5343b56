"""Decode steps on fixed-size inputs, replayed from captured CUDA graphs.

On a GPU a small model's decode step is bound by launching its kernels, not by reading its weights:
the embedded llama-80m took 8.8 ms a step at batch 1 on an H200 whose memory reads its weights in
0.04 ms (docs/measurements.md). A CUDA graph replays the step's hundreds of kernels in one launch
(vLLM and SGLang capture decode the same way). A graph is a fixed sequence of kernels on fixed
addresses, so each is captured for one bucket of (batch size, block-table width): the step's
sequences are padded up to the bucket's batch size and their block tables up to its width.

Padding rows decode token 0 at position 0 with a context of one position; their K/V go to the
*scratch block*, one block past the ``num_blocks`` the block manager hands out, so they never touch
a sequence's blocks, and their logits are dropped. A sequence's row reads only its own
``context_lens`` positions, so its logits do not depend on the padding (on CPU, where the same path
runs without a graph for the tests, bit for bit; on a GPU a GEMM over more rows may pick another
kernel: ``benchmarks/gpu_check.py`` compares the tokens with the eager path's).

Steps outside every bucket (more sequences than ``max_num_seqs``' bucket, a context longer than
``MAX_CAPTURE_TOKENS``) and prefill steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pdserve.engine.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

# batch sizes captured (those up to max_num_seqs, and max_num_seqs itself): a step runs in the
# smallest that holds it, so padding is at most a third of a bucket above 8 rows
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_WIDTH_BLOCKS = 8  # block-table widths captured: MIN_WIDTH_BLOCKS * 2**i blocks
MAX_CAPTURE_TOKENS = 8192  # contexts longer than this decode eagerly (vLLM's max_seq_len_to_capture)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def buckets(max_num_seqs: int, max_blocks: int) -> tuple[list[int], list[int]]:
    """The batch sizes and block-table widths (blocks) to capture for ``max_num_seqs`` sequences of
    at most ``max_blocks`` blocks each (widths up to the smallest power-of-two multiple of
    ``MIN_WIDTH_BLOCKS`` that holds ``max_blocks``)."""
    sizes = [b for b in BATCH_BUCKETS if b < max_num_seqs] + [max_num_seqs]
    widths = [MIN_WIDTH_BLOCKS]
    while widths[-1] < max_blocks:
        widths.append(widths[-1] * 2)
    return sizes, widths


class _Bucket:
    """The fixed inputs of one (batch, width) bucket: ``staged`` int64 [4 * batch + batch * width]
    holds input ids, positions, slot mapping, context lengths and the block tables, in that order;
    ``logits`` [batch, vocab_size] is what the forward wrote."""

    def __init__(self, batch: int, width: int, device: torch.device) -> None:
        self.batch, self.width = batch, width
        self.staged = torch.zeros(4 * batch + batch * width, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self.host = torch.zeros(self.staged.shape, dtype=torch.int64, pin_memory=pin)
        self.logits: torch.Tensor | None = None
        self.graph = None


class DecodeGraphs:
    """Runs decode steps through per-bucket fixed inputs: replayed CUDA graphs when ``capture``
    (CUDA only), else the same padded forward called directly (the CPU tests' path).

    ``forward(input_ids, positions, meta)`` -> logits [num_tokens, vocab_size] is the model's decode
    forward over the paged cache; ``scratch_slot`` the first slot of the scratch block (see the module
    docstring); ``max_blocks`` the longest block table a sequence can have."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        scratch_slot: int,
        capture: bool,
    ) -> None:
        self.forward, self.device, self.block_size = forward, device, block_size
        self.scratch_slot, self.capture = scratch_slot, capture
        cap_blocks = min(max_blocks, -(-MAX_CAPTURE_TOKENS // block_size))
        self.sizes, self.widths = buckets(max_num_seqs, cap_blocks)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self.replays = 0  # steps run through a bucket

    def bucket_for(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The (batch, width) bucket a step of ``num_seqs`` sequences whose longest block table has
        ``width`` blocks runs in, or None (run it eagerly)."""
        batch = next((b for b in self.sizes if b >= num_seqs), None)
        w = next((x for x in self.widths if x >= width), None)
        return None if batch is None or w is None else (batch, w)

    def capture_all(self) -> None:
        """Capture every bucket, the largest first (their memory pool is shared, and the largest
        needs the most), and log how long it took. No-op unless ``capture``."""
        if not self.capture:
            return
        start = time.perf_counter()
        for batch in reversed(self.sizes):
            for width in reversed(self.widths):
                self._get(batch, width)
        log.info(
            "captured %d decode graphs (batch sizes %s, block-table widths %s) in %.1f s",
            len(self._buckets),
            self.sizes,
            self.widths,
            time.perf_counter() - start,
        )

    def _run_forward(self, b: _Bucket) -> torch.Tensor:
        n, s = b.batch, b.staged
        tables = s[4 * n :].view(n, b.width).to(torch.int32)
        lens = s[3 * n : 4 * n].to(torch.int32)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(False, s[2 * n : 3 * n], tables, lens, qsl)
        return self.forward(s[:n], s[n : 2 * n], meta)

    def _get(self, batch: int, width: int) -> _Bucket:
        b = self._buckets.get((batch, width))
        if b is not None:
            return b
        b = _Bucket(batch, width, self.device)
        self._fill(b, [], [], [], [], [])  # all padding: what the capture runs on
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up runs, as torch.cuda.graph asks
                for _ in range(2):
                    self._run_forward(b)
            torch.cuda.current_stream().wait_stream(side)
            b.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b.graph, pool=self._pool):
                b.logits = self._run_forward(b)
            self._pool = b.graph.pool()
        self._buckets[(batch, width)] = b
        return b

    def _fill(self, b: _Bucket, ids, positions, slots, lens, tables) -> None:
        n, pad = b.batch, b.batch - len(ids)
        rows = [t + [0] * (b.width - len(t)) for t in tables] + [[0] * b.width] * pad
        flat = [
            *ids,
            *[0] * pad,
            *positions,
            *[0] * pad,
            *slots,
            *[self.scratch_slot] * pad,
            *lens,
            *[1] * pad,
            *[x for row in rows for x in row],
        ]
        assert len(flat) == 4 * n + n * b.width
        b.host.copy_(torch.tensor(flat, dtype=torch.int64))
        b.staged.copy_(b.host, non_blocking=True)

    def run(
        self,
        bucket: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """One decode step of ``len(input_ids)`` sequences in ``bucket`` (from ``bucket_for``);
        host lists as ``AttentionMetadata`` describes them (tables without freed entries). Returns
        their logits [num_seqs, vocab_size], a view of the bucket's buffer valid until its next run."""
        b = self._get(*bucket)
        self._fill(b, input_ids, positions, slot_mapping, context_lens, block_tables)
        if b.graph is not None:
            b.graph.replay()
        else:
            b.logits = self._run_forward(b)
        self.replays += 1
        return b.logits[: len(input_ids)]
