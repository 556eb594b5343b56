"""The engine: scheduler + block manager + model runner behind a small step API.

Roles compose it (see prefill_worker/ and decode_worker/): a prefill worker adds requests and
takes each sequence out with ``extract_kv`` right after its prefill step; a decode worker admits
sequences with ``admit_kv`` and runs decode steps; a colocated worker does both in one loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, describe_scheduling
from pdserve.engine.kv.codec import ModelFingerprint
from pdserve.engine.kv.fingerprint import layer_layout
from pdserve.engine.kv_handoff import KvHandoff
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.loader import config_hash, resolve_model_dir, weights_hash
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.batch import batch_shape
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.scheduler import Scheduler
from pdserve.engine.scheduling.sequence import FinishReason, Sequence
from pdserve.engine.step_types import KvCacheFullError, StepError, StepOutput
from pdserve.engine.text.tokenizer import Tokenizer

__all__ = ["KvCacheFullError", "LLMEngine", "StepError", "StepOutput"]  # KvCacheFullError: for the roles
log = logging.getLogger(__name__)


class LLMEngine(KvHandoff):
    """Single-process engine. Not thread-safe: drive it from one thread (see ``EngineLoop``). The KV
    hand-off methods (``pin_prefix``, ``admit_kv``, ``reserve_kv``, ``extract_kv`` ..) are ``KvHandoff``'s."""

    def __init__(
        self,
        cfg: EngineConfig,
        runner_factory: Callable[[EngineConfig, Path], ModelRunner] | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        """``runner_factory(cfg, model_dir)`` builds the model runner (default ``ModelRunner``: the
        weights and the KV cache); ``clock`` gives the nanoseconds steps are timed by (default
        ``time.monotonic_ns``). The simulator (``planner/simulate.py``) passes virtual ones."""
        if cfg.torch_threads and cfg.device == "cpu":
            usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            if cfg.torch_threads > usable:  # OpenMP teams larger than the cores spin waiting for each other
                raise ValueError(
                    f"{cfg.torch_threads} torch threads exceed the {usable} CPUs this process may run on "
                    f"(--threads {usable} or fewer)"
                )
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.model_dir: Path = resolve_model_dir(cfg.model)
        self.tokenizer = Tokenizer.from_folder(self.model_dir)
        self.runner = (runner_factory or ModelRunner)(cfg, self.model_dir)
        self.clock = clock or time.monotonic_ns
        self.prefill_busy_ns = self.decode_busy_ns = 0  # in steps with a prompt chunk / decode-only steps
        # called after each step with its ``batch_shape``, its start and end ns (self.clock) and the engine
        # thread's CPU ns in it; worker/step_trace.py writes them
        self.step_trace: Callable[[tuple, int, int, int], None] | None = None
        self.model_cfg = self.runner.model_cfg
        self.blocks = BlockManager(
            self.runner.num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            group_windows=self.runner.kv_groups.windows,
        )
        self.scheduler = Scheduler(
            self.blocks,
            cfg.max_num_seqs,
            cfg.token_budget,
            cfg.enable_chunked_prefill,
            None if cfg.target_itl_ms is None else cfg.target_itl_ms / 1e3,
        )
        log.info("scheduling: %s", describe_scheduling(cfg))
        self.eos_token_ids = self.tokenizer.eos_token_ids  # tokenizer, config.json and generation_config
        max_pos = self.model_cfg.max_position_embeddings
        if cfg.max_model_len and cfg.max_model_len > max_pos:
            log.warning(
                "max_model_len %d exceeds the model's %d positions; using %d", cfg.max_model_len, max_pos, max_pos
            )
        self.max_model_len = min(cfg.max_model_len or max_pos, max_pos)
        self.runner.start_decode_graphs(self.max_model_len)
        mc = self.model_cfg
        self.fingerprint = ModelFingerprint(
            mc.architecture,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            self.runner.dtype_name,
            cfg.block_size,
            self.tokenizer.content_hash,
            weights_hash(self.model_dir),
            config_hash(self.model_dir),
            layer_layout([mc.head_dim] * mc.num_layers, list(mc.layer_windows)),
            cfg.quantization,
        )
        self._digest = self.fingerprint.digest()
        self._pinned: dict[str, Sequence] = {}  # request id -> prefix held for its coming KV (pin_prefix)

    # -- requests -------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """ValueError with a readable message when the request can never run on this engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if n + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context window of {self.max_model_len} tokens"
            )
        step = self.cfg.token_budget if self.cfg.enable_chunked_prefill else n
        need = self.blocks.max_blocks_for(n + sampling.max_tokens, step)  # a window frees blocks behind it
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks; the cache has {self.blocks.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Sequence:
        """Queue a prompt for prefill (ValueError as in ``check_request``)."""
        self.check_request(prompt_token_ids, sampling)
        seq = Sequence.new(request_id, prompt_token_ids, sampling, self.eos_token_ids)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a waiting or running request and free its blocks; returns it, or None if unknown."""
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)
        return seq

    # -- stepping -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one model step (prefill chunks and decode tokens, see ``Scheduler``). Returns a
        token for each sequence that sampled one; finished sequences leave the engine and free
        their blocks.

        If the forward pass raises, every sequence of the batch is finished with ERROR and freed,
        and StepError (carrying them) is raised.
        """
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        now = self.clock()
        for s in batch.seqs:
            if not s.prefill_start_ns:
                s.prefill_start_ns = now
        if self.step_trace is not None:
            shape, cpu = batch_shape(batch), time.thread_time_ns()
        try:
            tokens = self.runner.run(batch)
        except Exception as exc:
            for s in batch.seqs:
                self.scheduler.finish(s, FinishReason.ERROR)
            raise StepError(exc, batch.seqs) from exc
        done = self.clock()
        if self.step_trace is not None:
            self.step_trace(shape, now, done, time.thread_time_ns() - cpu)
        self.scheduler.observe_step(batch, (done - now) / 1e9)
        if batch.is_prefill:
            self.prefill_busy_ns += done - now
        else:
            self.decode_busy_ns += done - now
        outputs = []
        for c in self.scheduler.complete(batch, tokens):
            if c.token is None:
                continue
            if c.prefill:
                c.seq.prefill_end_ns = done
            outputs.append(StepOutput(c.seq, c.token, c.prefill))
        return outputs

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Offline batch generation (all prompts at once); returns the output ids per prompt."""
        seqs = [self.add_request(f"offline-{i}", p, sampling) for i, p in enumerate(prompts)]
        while self.has_work():
            self.step()
        return [s.output_token_ids for s in seqs]

    def stats(self) -> dict[str, int]:
        """Queue lengths, KV block occupancy and busy time (ns). Safe from any thread while the engine
        steps (reads snapshots, never waits for a step); the values may be one step old."""
        s = self.scheduler
        waiting = list(s.waiting)  # atomic copy under the GIL
        return {
            "num_waiting": len(waiting),
            "num_running": len(s.running),
            "used_kv_blocks": self.blocks.num_used,
            "free_kv_blocks": self.blocks.num_free,
            "block_size": self.cfg.block_size,
            "model_fingerprint": self._digest,
            "outstanding_prefill_tokens": sum(q.num_tokens for q in waiting),
            "cached_kv_blocks": self.blocks.num_cached,
            "prefix_query_tokens": s.num_prompt_tokens_admitted,
            "prefix_hit_tokens": s.num_cached_tokens_admitted,
            "prefill_busy_ns": self.prefill_busy_ns,
            "decode_busy_ns": self.decode_busy_ns,
        }
