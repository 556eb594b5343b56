"""Owns the model weights and the paged KV cache; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.models.llama import AttentionMetadata, LlamaModel
from pdserve.engine.models.loader import load_weights
from pdserve.engine.sampling import sample
from pdserve.engine.scheduling.scheduler import Batch
from pdserve.engine.scheduling.sequence import Sequence


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: layers * 2 (K, V) * block_size * kv_heads * head_dim * itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


class ModelRunner:
    """Runs the forward pass over the paged KV cache.

    ``kv_cache``: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, cfg: EngineConfig, model_dir: Path) -> None:
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_folder(model_dir)
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.model = LlamaModel(self.model_cfg, load_weights(model_dir, self.model_cfg, self.dtype, cfg.device))
        per_block = kv_bytes_per_block(self.model_cfg, cfg.block_size, self.dtype)
        self.num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_gib * (1 << 30)) // per_block)
        mc = self.model_cfg
        self.kv_cache = torch.zeros(mc.num_layers, 2, self.num_blocks, cfg.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Slot mapping [end - start] of positions start..end-1 of ``seq``."""
        bs = self.cfg.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def run(self, batch: Batch) -> list[int]:
        """One model step; returns one sampled token per sequence, in batch order."""
        seqs = batch.seqs
        if batch.is_prefill:
            ids = [t for s in seqs for t in s.token_ids]
            positions = torch.cat([torch.arange(s.num_tokens) for s in seqs])
            slot_mapping = torch.cat([self.slots(s, 0, s.num_tokens) for s in seqs])
            cu = [0]
            for s in seqs:
                cu.append(cu[-1] + s.num_tokens)
            meta = AttentionMetadata(True, slot_mapping, cu_seqlens=cu)
            last = torch.tensor(cu[1:], device=self.device) - 1
        else:
            ids = [s.token_ids[-1] for s in seqs]
            positions = torch.tensor([s.num_tokens - 1 for s in seqs])
            slot_mapping = torch.cat([self.slots(s, s.num_tokens - 1, s.num_tokens) for s in seqs])
            width = max(len(s.block_table) for s in seqs)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                  dtype=torch.int64, device=self.device)
            lens = torch.tensor([s.num_tokens for s in seqs], device=self.device)
            meta = AttentionMetadata(False, slot_mapping, block_tables=tables, context_lens=lens)
            last = None
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(input_ids, positions.to(self.device), meta, self.kv_cache)
        if last is not None:
            hidden = hidden[last]
        logits = self.model.compute_logits(hidden)
        return sample(logits, [s.sampling for s in seqs], [s.num_output_tokens for s in seqs])

    def read_kv(self, seq: Sequence, num_positions: int) -> torch.Tensor:
        """Copy positions 0..num_positions-1 of ``seq`` out of the cache: [num_layers, 2, n, kv_heads, head_dim] on CPU."""
        flat = self.kv_cache.flatten(2, 3)  # [L, 2, num_blocks * block_size, kv_heads, D]
        return flat[:, :, self.slots(seq, 0, num_positions)].cpu()

    def write_kv(self, seq: Sequence, kv: torch.Tensor) -> None:
        """Write ``kv`` [num_layers, 2, n, kv_heads, head_dim] into positions 0..n-1 of ``seq``."""
        flat = self.kv_cache.flatten(2, 3)
        flat[:, :, self.slots(seq, 0, kv.shape[2])] = kv.to(device=self.device, dtype=self.dtype)
