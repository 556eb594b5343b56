"""Layer-wise KV hand-off, prefill side: each layer's KV leaves while the next layers run.

:class:`LayerStreamer` is the model runner's layer hook (``ModelRunner.layer_hook``). After layer i
of a prefill step it copies, for every sequence of the step whose stream is open, the K and V of
layer i that the decode worker does not have yet (the positions this step computed, and on the
first step those before it that came from this worker's prefix cache) into host memory, and hands
them to the request's push on the event loop (``loop.call_soon_threadsafe``); the forward goes on
at once. The push (:meth:`PrefillWorker._push_stream`) encodes them into the frames of
:mod:`pdserve.engine.kv.layer_frames` and sends each as it comes. With chunked prefill, each step
sends its chunk's layers; the end frame follows the step that sampled the first token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv.layer_frames import KvStreamEnd, KvStreamHead, LayerKv, frame_start
from pdserve.engine.kv.paged import read_layer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduling.batch import Batch
from pdserve.engine.scheduling.prefix_hash import prefix_hashes


@dataclass
class _Stream:
    skip_tokens: int  # prompt positions the decode worker holds (rounded down to whole blocks)
    put: Callable[[object], None]  # thread-safe: into the push's queue
    kv_start: int | None = None  # set with the head, on the sequence's first prefill step
    sent: int = 0  # positions sent in every layer


class LayerStreamer:
    """Open streams by request id; called by the engine thread after every layer of a prefill step.

    Items put into a stream's queue, in order: a :class:`KvStreamHead`, then a :class:`LayerKv` per
    layer and step (``kv`` [2, tokens, num_kv_heads, head_dim] on CPU, owned by the item), then a
    :class:`KvStreamEnd` (:meth:`end`). With no stream open a call returns at once.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, skip_tokens: int = 0) -> asyncio.Queue:
        """Event loop: a queue that will receive the stream of ``request_id`` once its prefill runs."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        stream = _Stream(skip_tokens, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        with self._lock:
            self._streams[request_id] = stream
        return queue

    def close(self, request_id: str) -> None:
        """Any thread: stop streaming ``request_id`` (no more items are put)."""
        with self._lock:
            self._streams.pop(request_id, None)

    def streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    def __call__(self, batch: Batch, layer: int, cache: torch.Tensor) -> None:
        """Engine thread, after ``layer`` of ``batch`` ran; ``cache``: that layer's part of the paged cache."""
        if not self._streams:
            return
        mc, bs = self.engine.model_cfg, self.engine.cfg.block_size
        last, window = layer == mc.num_layers - 1, mc.layer_windows[layer] if mc.layer_windows else None
        table = self.engine.runner.kv_groups.group_of[layer]
        for i, seq in enumerate(batch.seqs):
            stream = self._streams.get(seq.request_id)
            if stream is None:
                continue
            if stream.kv_start is None:  # layer 0 of its first step: the head goes first
                stream.kv_start = stream.sent = self._kv_start(seq.num_tokens, stream.skip_tokens)
                stream.put(self._head(seq, stream.kv_start))
            end = seq.num_computed_tokens + batch.num_query_tokens[i]
            if end <= stream.sent:  # a chunk recomputed after a preemption: sent already
                continue
            # a sliding-window layer sends only what the first decode query's window reads
            first = frame_start(window, bs, seq.num_tokens, stream.sent, end)
            if first < end:  # on a GPU this copy waits for the layer's kernels (a synchronous device-to-host copy)
                kv = read_layer(cache, seq.block_tables[table], first, end).cpu()
            else:
                kv = torch.empty((2, 0, *cache.shape[3:]), dtype=cache.dtype)
            stream.put(LayerKv(layer, first, kv))
            if last:
                stream.sent = end

    def _kv_start(self, num_tokens: int, skip_tokens: int) -> int:
        """The first position sent, as ``LLMEngine.extract_kv`` computes it for the whole frame."""
        bs = self.engine.cfg.block_size
        return min(max(skip_tokens, self.engine.blocks.window_start(num_tokens)), num_tokens - 1) // bs * bs

    def _head(self, seq, kv_start: int) -> KvStreamHead:
        e, ids = self.engine, list(seq.token_ids)  # the prompt: no token sampled yet
        hashes = prefix_hashes(ids[:kv_start], e.cfg.block_size)
        return KvStreamHead(seq.request_id, e.fingerprint, ids, seq.sampling.to_dict(), kv_start, hashes)

    def end(self, request_id: str, first_token: int, first_token_unix_ns: int) -> bool:
        """Engine thread, after the step that sampled the first token: close the stream with its end
        frame. False (and nothing put) when no stream was open or none of it was sent."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is None or stream.kv_start is None:
            return False
        stream.put(KvStreamEnd(first_token, first_token_unix_ns))
        return True
