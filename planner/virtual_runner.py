"""A model runner that computes nothing: each step advances a virtual clock by the step-time
model's prediction for its batch. ``LLMEngine(cfg, runner_factory, clock)`` runs on it with its
real scheduler, block manager, prefix cache and KV hand-off paths (``planner/simulate.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import kv_pool_blocks
from pdserve.engine.scheduling.batch import Batch, batch_shape
from pdserve.engine.scheduling.kv_groups import kv_groups
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.planner.step_model import StepModel


@dataclass(frozen=True)
class StepFactors:
    """How much longer a worker's steps take than the step model predicts: prompt chunks on an
    idle machine (``lone``: ``pdserve profile``'s lone requests), prompt chunks under load
    (``loaded``: beside decode rows or other workers' steps, its load points), decode rows only
    (``decode``, its load points)."""

    lone: float = 1.0
    loaded: float = 1.0
    decode: float = 1.0


class VirtualClock:
    """One worker's time, seconds since the simulation started."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def ns(self) -> int:
        """The time in integer nanoseconds (``LLMEngine``'s ``clock``)."""
        return round(self.now_s * 1e9)


class VirtualRunner:
    """Stands in for ``ModelRunner``: same ``model_cfg``, ``dtype_name``, ``num_blocks`` (from
    ``num_kv_blocks`` or ``kv_cache_gib`` as the real one sizes its cache), no weights, no cache
    tensor. ``run`` returns ``token`` (set it to an id that is no EOS) for each sampling sequence
    and adds ``model.batch_s`` of the batch to ``clock`` times ``factors`` (a serving worker's steps
    against the profiled engine's, ``StepFactors``; a step with prompt chunks is loaded when it
    has decode rows too or ``neighbours_busy``: another worker on its cores' machine computes as it
    starts); ``trace`` (when a list) gets each step
    as ``[(request_id, tokens), ...]``. ``read_kv`` gives a zero-stride tensor of the real shape
    (``nbytes`` as the real one), ``write_kv`` checks the shape only. ValueError for an unknown
    ``dtype_name``."""

    def __init__(
        self, cfg: EngineConfig, model_dir: Path, model: StepModel, dtype_name: str, clock: VirtualClock
    ) -> None:
        if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
            raise ValueError(f"profile dtype {dtype_name!r} is no torch dtype")
        self.cfg, self.model, self.clock = cfg, model, clock
        self.model_cfg = ModelConfig.from_folder(model_dir)
        self.dtype_name, self.dtype = dtype_name, getattr(torch, dtype_name)
        self.kv_groups = kv_groups(self.model_cfg.layer_windows, self.model_cfg.num_layers)
        self.num_blocks = kv_pool_blocks(cfg, self.model_cfg, self.dtype)
        self.token = 0
        self.factors = StepFactors()
        self.neighbours_busy = False
        self.trace: list | None = None
        self.num_steps = 0

    def start_decode_graphs(self, max_model_len: int) -> None:
        """No graphs to capture: a virtual step's time comes from the profile, captured or not."""

    def run(self, batch: Batch) -> list[int]:
        """Advance the clock by the batch's predicted seconds; one ``token`` per sampling sequence."""
        chunks, b, context = batch_shape(batch)
        f = self.factors
        self.clock.now_s += self.model.batch_s(chunks, b, context) * (
            (f.loaded if b or self.neighbours_busy else f.lone) if chunks else f.decode
        )
        self.num_steps += 1
        if self.trace is not None:
            self.trace.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_query_tokens)])
        return [self.token] * sum(1 for i in range(len(batch.seqs)) if batch.samples(i))

    def _shape(self, n: int) -> tuple[int, ...]:
        mc = self.model_cfg
        return (mc.num_layers, 2, n, mc.num_kv_heads, mc.head_dim)

    def read_kv(self, seq: Sequence, num_positions: int, alloc=None, start: int = 0) -> torch.Tensor:
        """Placeholder KV of positions start..num_positions-1: [layers, 2, n, kv_heads, head_dim]."""
        return torch.zeros((), dtype=self.dtype).expand(self._shape(num_positions - start))

    def write_kv(self, seq: Sequence, kv: torch.Tensor, start: int = 0) -> None:
        """ValueError when ``kv`` is not of the model's KV layout."""
        if tuple(kv.shape) != self._shape(kv.shape[2]):
            raise ValueError(f"KV of shape {tuple(kv.shape)} for a cache of {self._shape(kv.shape[2])}")
