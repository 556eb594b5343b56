"""Layer-wise KV hand-off, decode side: one PushKv call's stream written into the cache as it lands."""

from __future__ import annotations

import asyncio
import time

from pdserve.engine.kv.codec import KvCodecError
from pdserve.engine.kv.layer_frames import KvStreamEnd, KvStreamHead, LayerKv
from pdserve.engine.kv.paged import write_layer
from pdserve.worker.host import abort_quietly


class LayerWriter:
    """Acts on the events of a ``KvStreamDecoder`` for a ``DecodeWorker``.

    The head reserves the request's KV blocks (``LLMEngine.reserve_kv``, with the worker's retries
    while the cache is full); each layer frame is copied from its receive buffer straight into those
    blocks (``paged.write_layer``; no copy of the whole prompt's KV is staged); the end frame admits
    the sequence into the running batch (``LLMEngine.admit_reserved``). :meth:`release` gives the
    blocks back unless the sequence was admitted: call it whatever way the call ends.
    """

    def __init__(self, worker) -> None:
        self.worker = worker
        self.seq = None  # the reserved sequence, until admitted or released
        self.admitted = False
        self.nbytes = 0
        self.reserve_s = 0.0  # seconds the head's reservation waited (KV blocks short)
        self.start = 0.0

    async def on_event(self, request_id: str, event) -> bool:
        """Act on one event; False when the request's Decode stream went away (stop reading).
        KvCodecError for a head of another request; the worker's placement errors for the head."""
        w = self.worker
        if isinstance(event, KvStreamHead):
            if event.request_id != request_id:
                raise KvCodecError(f"head frame of request {event.request_id!r} in the push of {request_id!r}")
            start = time.monotonic()
            self.seq = await w._place(request_id, lambda e, preempt: e.reserve_kv(event, preempt), True)
            self.reserve_s = time.monotonic() - start  # the wait for blocks counts as admission
            return self.seq is not None
        fut = w._pending.get(request_id)
        if fut is None or fut.done():
            return False
        if isinstance(event, LayerKv):
            runner = w.engine.runner
            table = self.seq.block_tables[runner.kv_groups.group_of[event.layer]]
            write_layer(runner.layer_caches[event.layer], table, event.start, event.kv)
            self.nbytes += event.kv.nbytes
            w.kv_buffers.give(event.kv)
            return True
        assert isinstance(event, KvStreamEnd)
        seq = self.seq
        self.start = time.monotonic() - self.reserve_s  # admission: the reservation plus this last step
        await asyncio.wrap_future(w.host.loop.submit(lambda e: e.admit_reserved(seq, event.first_token)))
        self.admitted, self.seq = True, None
        if fut.done():  # the stream went away while we were admitting
            await abort_quietly(w.host.loop, request_id)
        else:
            w._admitted(seq, event.first_token_unix_ns, self.nbytes, self.start)
        return True

    def release(self) -> None:
        """Give the reserved blocks back (on the engine thread, without waiting) unless admitted."""
        seq, self.seq = self.seq, None
        if seq is not None and not self.admitted:
            self.worker.host.loop.submit(lambda e: e.release_kv(seq))
