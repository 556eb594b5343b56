"""Owns the model weights and the paged KV cache; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.models.attention import AttentionMetadata, select_backend
from pdserve.engine.models.dtype import resolve_dtype
from pdserve.engine.models.loader import load_weights
from pdserve.engine.models.ops import select_ops
from pdserve.engine.models.quant import quantization
from pdserve.engine.models.registry import family_module
from pdserve.engine.sampling import sample
from pdserve.engine.scheduling.block_manager import NULL_BLOCK
from pdserve.engine.scheduling.kv_groups import kv_groups
from pdserve.engine.scheduling.scheduler import Batch
from pdserve.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: group_size * 2 (K, V) * block_size * kv_heads * head_dim * itemsize, where
    ``group_size`` is the layers of one KV cache group (``kv_groups``; all layers unless the model is hybrid)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = kv_groups(cfg.layer_windows, cfg.num_layers).group_size
    return layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_pool_blocks(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Blocks of the KV pool: ``num_kv_blocks`` blocks of every layer (a hybrid model's pool holds their
    memory in blocks of one KV cache group), else as many as ``kv_cache_gib`` GiB hold (at least 1)."""
    if cfg.num_kv_blocks:
        groups = kv_groups(model_cfg.layer_windows, model_cfg.num_layers)
        return cfg.num_kv_blocks * model_cfg.num_layers // groups.group_size
    return max(1, int(cfg.kv_cache_gib * (1 << 30)) // kv_bytes_per_block(model_cfg, cfg.block_size, dtype))


class ModelRunner:
    """Runs the forward pass over the paged KV cache.

    ``kv_cache``: [group_size, 2, num_blocks + 1, block_size, num_kv_heads, head_dim], one pool for
    every KV cache group (``kv_groups``: one group of all layers unless the model is hybrid); layer i
    reads and writes ``layer_caches[i]`` (``kv_cache[kv_groups.slot_of[i]]``) through its group's
    block table. The last block is the scratch block of padded decode rows (``decode_graphs``),
    never handed out. ``graphs``: the
    decode steps' fixed-size path (``start_decode_graphs``), or None (eager). ``layer_hook``:
    None, or called as ``layer_hook(batch, i, layer_caches[i])`` after layer i of every prefill step
    (``CausalLM.layer_hook``; the layer-wise KV hand-off).
    """

    layer_hook: Callable[[Batch, int, torch.Tensor], None] | None = None
    graphs: DecodeGraphs | None = None

    def __init__(self, cfg: EngineConfig, model_dir: Path) -> None:
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_folder(model_dir)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {cfg.device}: this torch build sees no CUDA device")
        mc = self.model_cfg
        self.dtype_name, self.dtype_reason = resolve_dtype(cfg.dtype, mc.torch_dtype, self.device)
        log.info("dtype %s: %s", self.dtype_name, self.dtype_reason)
        self.dtype = getattr(torch, self.dtype_name)
        backends = {  # one per distinct sliding window
            window: select_backend(
                cfg.attention_backend,
                self.device,
                self.dtype,
                mc.num_heads,
                mc.num_kv_heads,
                mc.head_dim,
                window,
                mc.attention_scale,
                mc.attn_logit_softcapping,
            )
            for window in dict.fromkeys(mc.layer_windows)
        }
        with quantization(cfg.quantization, cfg.lm_head_quantization):  # engine/models/quant.py
            self.model = family_module(mc.architecture).build(
                mc,
                load_weights(model_dir, mc, self.dtype, cfg.device),
                lambda layer: backends[mc.layer_windows[layer]],
                select_ops(self.device, self.dtype),
            )
        if cfg.quantization != "none" or cfg.lm_head_quantization != "none":
            log.info("weights quantized: decoder linears %s, lm_head %s", cfg.quantization, cfg.lm_head_quantization)
        self.kv_groups = kv_groups(mc.layer_windows, mc.num_layers)
        self._group_of = self.kv_groups.group_of
        # tables may hold NULL_BLOCK (block_manager.py)
        self._frees_blocks = any(w is not None for w in self.kv_groups.windows)
        self.num_blocks = kv_pool_blocks(cfg, mc, self.dtype)
        shape = (self.kv_groups.group_size, 2, self.num_blocks + 1, cfg.block_size, mc.num_kv_heads, mc.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, torch.OutOfMemoryError) as exc:  # the allocator's own text names bytes only
            gib = math.prod(shape) * self.dtype.itemsize / (1 << 30)
            raise ValueError(f"a KV cache of {self.num_blocks} blocks ({gib:.1f} GiB) does not fit in memory here; "
                             "lower --kv-cache-gib or --num-kv-blocks") from exc  # fmt: skip
        self.layer_caches = [self.kv_cache[j] for j in self.kv_groups.slot_of]
        # each group's layers, as ``read_kv`` / ``write_kv`` index the payload
        self._group_rows = [torch.tensor(ls, device=self.device) for ls in self.kv_groups.layers]
        if self.kv_groups.num_groups == 1:
            self._group_rows = [slice(None)]

    def start_decode_graphs(self, max_model_len: int, capture: bool | None = None) -> None:
        """Run decode steps through ``DecodeGraphs`` for contexts up to ``max_model_len`` tokens.
        ``capture`` None: capture CUDA graphs on a CUDA device unless ``enforce_eager``, and on a mixture
        of experts (its routing reads expert counts on the host) or a CPU run eagerly as before; True /
        False: replayed graphs / the same padded path without a graph (CPU tests). A hybrid model
        (several KV cache groups) always decodes eagerly."""
        if self.kv_groups.num_groups > 1:
            return
        if capture is None:
            if self.device.type != "cuda" or self.cfg.enforce_eager or self.model_cfg.num_experts:
                return
            capture = True
        model, cache = self.model, self.kv_cache
        self.graphs = DecodeGraphs(
            lambda ids, pos, meta: model.compute_logits(model.forward(ids, pos, meta, cache)),
            self.device,
            self.cfg.block_size,
            self.cfg.max_num_seqs,
            -(-max_model_len // self.cfg.block_size),
            self.num_blocks * self.cfg.block_size,
            capture,
        )
        self.graphs.capture_all()

    def slots(self, seq: Sequence, start: int, end: int, group: int = 0) -> list[int]:
        """Slot mapping of positions start..end-1 of ``seq`` in KV cache group ``group`` (host ints)."""
        bs, table = self.cfg.block_size, seq.block_tables[group]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def run(self, batch: Batch) -> list[int]:
        """One model step; returns one sampled token per sequence whose chunk reaches its last
        token (``Batch.samples``), in batch order (one host sync).

        Each sequence computes positions ``num_computed_tokens .. + num_query_tokens - 1``; their
        queries attend to the cached positions before them and to each other, causally."""
        seqs, counts = batch.seqs, batch.num_query_tokens
        width = max(len(s.block_table) for s in seqs)
        bucket = None if batch.is_prefill or self.graphs is None else self.graphs.bucket_for(len(seqs), width)
        if bucket is not None:
            return self._decode_in(bucket, seqs)
        starts = [s.num_computed_tokens for s in seqs]
        ends = [a + n for a, n in zip(starts, counts)]
        lens = self._tensor(ends, torch.int32)
        if batch.is_prefill:
            ids = [t for s, a, b in zip(seqs, starts, ends) for t in s.token_ids[a:b]]
            positions = [p for a, b in zip(starts, ends) for p in range(a, b)]
        else:  # one token per sequence, its last
            ids = [s.token_ids[-1] for s in seqs]
            positions = starts
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        metas = []
        for g in range(self.kv_groups.num_groups):  # each group's block tables and slot mapping
            rows = [s.block_tables[g] + [0] * (width - len(s.block_tables[g])) for s in seqs]
            tables = self._tensor(rows, torch.int32)
            if self._frees_blocks:  # entries freed outside the window (-1) point at block 0, never read
                tables.clamp_(min=0)
            slot_mapping = [x for s, a, b in zip(seqs, starts, ends) for x in self.slots(s, a, b, g)]
            metas.append(
                AttentionMetadata(
                    batch.is_prefill,
                    self._tensor(slot_mapping, torch.int64),
                    tables,
                    lens,
                    self._tensor(cu, torch.int32),
                    cu_seqlens=cu,
                    context_lens_host=ends,
                )
            )
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self._group_of]
        hook = self.layer_hook if batch.is_prefill else None
        self.model.layer_hook = None if hook is None else functools.partial(hook, batch)
        hidden = self.model.forward(
            self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), meta, self.layer_caches
        )
        sampled = [i for i in range(len(seqs)) if batch.samples(i)]
        if not sampled:  # every chunk stopped short of its prompt's end
            return []
        if batch.is_prefill:
            hidden = hidden[self._tensor([cu[i + 1] - 1 for i in sampled], torch.int64)]
        logits = self.model.compute_logits(hidden)
        chosen = [seqs[i] for i in sampled]
        return sample(
            logits, [s.sampling for s in chosen], [s.sampling.step_offset + s.num_output_tokens for s in chosen]
        )

    def _decode_in(self, bucket: tuple[int, int], seqs: list[Sequence]) -> list[int]:
        """A decode step through ``graphs`` (one token per sequence, its last)."""
        starts = [s.num_computed_tokens for s in seqs]
        logits = self.graphs.run(
            bucket,
            [s.token_ids[-1] for s in seqs],
            starts,
            [self.slots(s, a, a + 1)[0] for s, a in zip(seqs, starts)],
            [a + 1 for a in starts],
            [[max(b, 0) for b in s.block_table] if self._frees_blocks else s.block_table for s in seqs],
        )
        return sample(logits, [s.sampling for s in seqs], [s.sampling.step_offset + s.num_output_tokens for s in seqs])

    def _runs(self, seq: Sequence, n: int, start: int, group: int) -> list[tuple[int, int, int]]:
        """Positions start..n-1 of ``seq`` (``start`` a multiple of the block size) in KV cache group
        ``group`` as runs over consecutive block ids: (first position, end position, first block),
        relative to ``start``. They fill whole blocks, the last one possibly in part. In a group with
        a sliding window, positions whose blocks were freed outside it come as runs of ``NULL_BLOCK``;
        ValueError for those in a full-attention group, or when the table is too short."""
        bs, table = self.cfg.block_size, seq.block_tables[group]
        if start % bs:
            raise ValueError(f"start {start} is not a multiple of the block size {bs}")
        num_blocks = -(-n // bs)
        if len(table) < num_blocks:
            raise ValueError(f"{n} positions need {num_blocks} blocks; {seq.request_id} has {len(table)}")
        runs, i = [], start // bs
        if self.kv_groups.windows[group] is None and NULL_BLOCK in table[i:num_blocks]:
            raise ValueError(f"{seq.request_id}: positions from {start} include blocks freed outside the window")
        while i < num_blocks:
            j = i + 1
            step = 0 if table[i] == NULL_BLOCK else 1
            while j < num_blocks and table[j] == table[j - 1] + step and (table[j] == NULL_BLOCK) == (step == 0):
                j += 1
            runs.append((i * bs - start, min(j * bs, n) - start, table[i]))
            i = j
        return runs

    def _blocks(self, p0: int, p1: int, block: int) -> torch.Tensor:
        """The cache slots of positions p0..p1-1 of a run starting at ``block``:
        [group_size, 2, p1 - p0, kv_heads, D]."""
        count = -(-(p1 - p0) // self.cfg.block_size)
        return self.kv_cache[:, :, block : block + count].flatten(2, 3)[:, :, : p1 - p0]

    def _group_runs(self, seq: Sequence, n: int, start: int):
        """Per KV cache group: (its layers, as a slice when they are all layers in order, else an
        index tensor on the cache's device; its ``_runs``)."""
        for g, rows in enumerate(self._group_rows):
            yield rows, self._runs(seq, n, start, g)

    def read_kv(
        self, seq: Sequence, num_positions: int, alloc: Callable[[int], torch.Tensor] | None = None, start: int = 0
    ) -> torch.Tensor:
        """Copy positions start..num_positions-1 of ``seq`` out of the cache (``start`` a multiple of the
        block size): [num_layers, 2, num_positions - start, kv_heads, head_dim] on CPU. Positions a
        sliding-window layer freed (outside its window) read as zeros.

        Copies whole blocks, one slice copy per run of consecutive block ids, not slot by slot.
        ``alloc(nbytes)`` gives the CPU memory to copy into (a uint8 tensor of ``nbytes``; default: a new
        tensor)."""
        cache = self.kv_cache
        shape = (self.model_cfg.num_layers, 2, num_positions - start, *cache.shape[4:])
        host = None if alloc is None else alloc(math.prod(shape) * cache.element_size()).view(cache.dtype).view(shape)
        out = (
            host
            if host is not None and cache.device.type == "cpu"
            else torch.empty(shape, dtype=cache.dtype, device=cache.device)
        )
        for rows, runs in self._group_runs(seq, num_positions, start):
            for p0, p1, block in runs:
                out[rows, :, p0:p1] = 0 if block == NULL_BLOCK else self._blocks(p0, p1, block)
        if host is None:
            return out.cpu()
        if out is not host:  # gathered on the device: one copy into the host memory
            host.copy_(out)
        return host

    def write_kv(self, seq: Sequence, kv: torch.Tensor, start: int = 0) -> None:
        """Write ``kv`` [num_layers, 2, n, kv_heads, head_dim] into positions start..start+n-1 of ``seq``
        (``start`` a multiple of the block size), one slice copy per run of consecutive block ids;
        positions a sliding-window layer has no block for are skipped."""
        kv = kv.to(device=self.kv_cache.device, dtype=self.kv_cache.dtype)
        for rows, runs in self._group_runs(seq, start + kv.shape[2], start):
            for p0, p1, block in runs:
                if block != NULL_BLOCK:
                    self._blocks(p0, p1, block).copy_(kv[rows, :, p0:p1])
