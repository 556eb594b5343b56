"""The KV hand-off of ``pdserve profile``: a real decode worker on loopback, fed the way a prefill
worker feeds it.

For each prompt length a sequence is admitted into the profiled engine with random KV (the KV's
values do not change what a hand-off moves, and a prefill of the longest prompts would take longer
than all their hand-offs), then each timed hand-off
(``benchmarks/kv_handoff.py``'s ``e2e``) does what ``PrefillWorker`` does after a prefill step:

- ``read``: ``ModelRunner.read_kv`` out of the paged cache into reused host buffers
  (``HostBuffers``, as ``LLMEngine.extract_kv`` does it for a prefill worker);
- ``encode``: ``encode_kv`` (header, tensor view, checksum) on a worker thread;
- ``push``: the engine config's ``kv_transport`` (``kv_sender_for``: the KV data connection, or
  gRPC's ``PushKv``; 1 MiB chunks on 127.0.0.1), until the decode worker has decoded the frame
  (checks, checksum, copy) and written the KV into its paged cache (``LLMEngine.admit_kv``).

The decode worker (``decode_worker.serve``) runs in this process, on its own engine thread; it
then decodes one token per hand-off, which is not timed.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from pdserve.decode_worker.worker import serve
from pdserve.engine.kv.buffers import HostBuffers
from pdserve.engine.kv.codec import KvPayload, encode_kv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.planner.grid import Grid
from pdserve.prefill_worker.worker import kv_sender_for
from pdserve.rpc.auth import internal_channel
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.v1 import worker_pb2, worker_pb2_grpc

TRANSPORT = (
    "real: ModelRunner.read_kv + encode_kv + a push over {} to a decode worker (decode_worker.serve) "
    "on 127.0.0.1 in this process, until it returned (frame decoded, KV written into its cache)"
)


async def measure_handoff(
    engine: LLMEngine, grid: Grid, admit: Callable[[int], Sequence], say: Callable[[str], None]
) -> tuple[list[dict], str]:
    """One point per ``grid.handoff_tokens`` length (``admit(n)``: a sequence of ``n`` prompt tokens
    and its first token, its KV in ``engine``'s cache, finished here after its runs): ``tokens``, KV
    ``bytes``, the median ``read_s``, ``encode_s`` and ``push_s`` and the median total ``seconds``
    (``samples_s`` its runs), all in seconds; and a description of the transport. The runs are
    spread over the grid's passes, as the step points are."""
    top = max(grid.handoff_tokens) + 2
    cfg = replace(engine.cfg, num_kv_blocks=2 * engine.blocks.blocks_for(top), max_model_len=engine.max_model_len)
    worker = await serve(cfg)
    sender, buffers = kv_sender_for(engine.cfg), HostBuffers()
    channel = internal_channel(worker.address, GRPC_OPTIONS)
    stub = worker_pb2_grpc.DecodeServiceStub(channel)
    sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    runs: dict[int, list[tuple[float, float, float, float]]] = {n: [] for n in grid.handoff_tokens}
    nbytes: dict[int, int] = {}
    passes = grid.pass_repeats()
    try:
        for k, reps in enumerate(passes, 1):
            for n in grid.handoff_tokens:
                seq = admit(n)
                for i in range(grid.warmup + reps):
                    rid = f"profile-handoff-{n}-{k}-{i}"
                    stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=60))
                    await stream.initial_metadata()
                    t0 = time.perf_counter()
                    kv = engine.runner.read_kv(seq, n, buffers.take)
                    t1 = time.perf_counter()
                    payload = KvPayload(
                        rid, engine.fingerprint, seq.token_ids[:n], seq.token_ids[n], sampling.to_dict(), kv
                    )
                    frame = await asyncio.to_thread(encode_kv, payload)
                    t2 = time.perf_counter()
                    await sender.send_kv(worker.address, rid, frame)
                    t3 = time.perf_counter()
                    nbytes[n] = kv.numel() * kv.element_size()
                    buffers.give(kv)
                    tokens = [t async for batch in stream for t in batch.token_ids]
                    if len(tokens) != 1:
                        raise RuntimeError(
                            f"a decode worker answered a hand-off of {n} tokens with {len(tokens)} tokens"
                        )
                    if i >= grid.warmup:
                        runs[n].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
                engine.scheduler.finish(seq)
                total = statistics.median(r[3] for r in runs[n])
                say(f"handoff  n={n:5d} {nbytes[n] / 2**20:8.2f} MiB {total * 1e3:9.2f} ms   pass {k}/{len(passes)}")
    finally:
        await channel.close()
        await sender.close()
        await worker.stop()
    via = "the KV data connection (tcp)" if engine.cfg.kv_transport == "tcp" else "gRPC's PushKv"
    return [_point(n, nbytes[n], runs[n]) for n in grid.handoff_tokens], TRANSPORT.format(via)


def _point(n: int, nbytes: int, runs: list[tuple[float, float, float, float]]) -> dict:
    read, encode, push, total = (list(col) for col in zip(*runs))
    return {
        "tokens": n,
        "bytes": nbytes,
        "read_s": statistics.median(read),
        "encode_s": statistics.median(encode),
        "push_s": statistics.median(push),
        "seconds": statistics.median(total),
        "samples_s": total,
    }
