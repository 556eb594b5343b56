"""KV hand-off benchmark: prefill engine -> codec -> loopback transport -> decode worker's cache.

For each dtype and prompt length it prefills one prompt on ``embedded:llama-80m`` and times, with
min-of-N, every stage of the hand-off on its own and the whole hand-off end to end:

- ``read``: ``ModelRunner.read_kv`` out of the prefill engine's paged cache (into the prefill
  worker's reused host buffers); ``pack``: serialising the payload as the prefill worker does;
- ``push``: sending a packed frame over the row's transport (``grpc``: ``PushKv``; ``tcp``: the KV
  data connection) until the decode worker holds the decoded payload (checked and copied as it
  arrives);
- ``unpack``: decoding a whole frame (all checks, checksum, copy into the decode worker's buffers);
  ``write``: ``ModelRunner.write_kv`` into the decode engine's paged cache (on its engine thread);
- ``e2e``: read + the prefill worker's push (``PrefillWorker._push``) to a real decode worker on
  127.0.0.1, which decodes and admits the KV before the push returns; GB/s and the TTFT share
  (TTFT: this run's min-of-N prefill of the prompt plus ``e2e``) come from it.

The decode worker runs in this process, on its own engine thread and gRPC server; with
``--decode-process`` the ``e2e`` hand-offs go to one in a child process, as in split placement.
Lengths are capped at the model's context minus 2. Only the minimum of N runs is reported.

    python benchmarks/kv_handoff.py                       # 256/1024/4096 tokens, float32 + bfloat16
    python benchmarks/kv_handoff.py --lengths 1024 --dtypes bfloat16 --repeats 30 --decode-process
    python benchmarks/kv_handoff.py --transports tcp      # one transport (default: grpc,tcp side by side)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import subprocess
import sys
import time
import timeit

import grpc
import torch

import pdserve.decode_worker.worker as decode
import pdserve.prefill_worker.worker as prefill_mod
from pdserve.engine.config import KV_DTYPES, EngineConfig, ModelConfig
from pdserve.engine.kv import codec
from pdserve.engine.kv.codec import KvPayload, pack_kv, unpack_kv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduling.sequence import Sequence
from pdserve.prefill_worker.kv_sender import GrpcKvSender
from pdserve.prefill_worker.kv_tcp_sender import TcpKvSender
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker.flags import positive_int

MODEL = "embedded:llama-80m"
SERIALIZE = getattr(prefill_mod, "encode_kv", None) or prefill_mod.pack_kv  # the prefill worker's (older: pack_kv)


def best_ms(fn, repeats: int) -> float:
    """Min over ``repeats`` calls of ``fn()``, in ms."""
    return min(timeit.repeat(fn, number=1, repeat=repeats)) * 1e3


class Arrival:
    """Notes when the decode worker has the whole KV (the call that admits the decoded payload)."""

    def __init__(self, worker) -> None:
        self.name = "admit" if hasattr(worker, "admit") else "receive_kv"
        self.inner = getattr(worker, self.name)
        self.at = 0.0
        setattr(worker, self.name, self)

    async def __call__(self, arg) -> None:
        self.at = time.perf_counter()
        await self.inner(arg)


def read_stage(runner, seq: Sequence, n: int, buffers):
    """One read_kv as the prefill worker does it (its buffer goes back after the push)."""
    if buffers is None:
        return lambda: runner.read_kv(seq, n)
    return lambda: buffers.give(runner.read_kv(seq, n, buffers.take))


def unpack_stage(frame: bytes, fp, buffers):
    """One decode of ``frame`` as the decode worker does it (its buffer goes back after admission)."""
    if buffers is None:
        return lambda: unpack_kv(frame, fp)

    def run():
        decoder = codec.KvDecoder(fp, alloc=buffers.take)
        decoder.add(frame)
        buffers.give(decoder.finish().kv)

    return run


def prefill(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[Sequence, float]:
    """Prefill ``ids`` alone; returns the sequence (still holding its blocks) and the step's ms."""
    seq = engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.perf_counter()
    outs = engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    assert [o.seq for o in outs] == [seq] and outs[0].prefill
    return seq, ms


def write_ms(engine: LLMEngine, kv: torch.Tensor, ids: list[int], repeats: int) -> float:
    """Engine thread: time ``write_kv`` of ``kv`` into freshly allocated blocks."""
    seq = Sequence.new("bench-write", ids, SamplingParams(max_tokens=2), engine.eos_token_ids)
    engine.blocks.allocate(seq, len(ids))
    try:
        return best_ms(lambda: engine.runner.write_kv(seq, kv), repeats)
    finally:
        engine.blocks.free(seq)


async def handoffs(
    n: int, seq: Sequence, payload: KvPayload, engine: LLMEngine, server, e2e_address: str, transport: str, args
) -> tuple[float, float]:
    """Min-of-N ms of ``push`` (a packed frame, to ``server``) and ``e2e`` (read + the prefill worker's
    push, to the decode worker at ``e2e_address``), over ``transport``."""
    arrival = Arrival(server.worker)
    sender = GrpcKvSender(args.chunk_bytes) if args.chunk_bytes else GrpcKvSender()
    sender = TcpKvSender(sender) if transport == "tcp" else sender
    pworker = prefill_mod.PrefillWorker(engine, sender)  # not served: only its _push is used
    buffers = getattr(pworker, "kv_buffers", None)

    def read_kv(seq, n):
        return engine.runner.read_kv(seq, n) if buffers is None else engine.runner.read_kv(seq, n, buffers.take)

    channels = {a: grpc.aio.insecure_channel(a) for a in {server.address, e2e_address}}
    push, e2e = float("inf"), float("inf")
    try:
        for i in range(args.repeats):
            for mode, address in (("push", server.address), ("e2e", e2e_address)):
                rid = f"d{n}-{transport}-{mode}-{i}"
                stub = worker_pb2_grpc.DecodeServiceStub(channels[address])
                stream = stub.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=60))
                await stream.initial_metadata()
                if mode == "push":
                    frame = SERIALIZE(KvPayload(rid, *_rest(payload)))
                    t0 = time.perf_counter()
                    await sender.send_kv(server.address, rid, frame)
                    push = min(push, arrival.at - t0)
                else:
                    t0 = time.perf_counter()
                    kv = await asyncio.to_thread(read_kv, seq, n)  # extract_kv, on the engine thread
                    await pworker._push(address, KvPayload(rid, *_rest(payload, kv)))
                    e2e = min(e2e, time.perf_counter() - t0)
                tokens = [t for batch in [b async for b in stream] for t in batch.token_ids]
                assert len(tokens) == 1, f"hand-off of {rid} failed"
    finally:
        for channel in channels.values():
            await channel.close()
        await sender.close()
    return push * 1e3, e2e * 1e3


def _rest(p: KvPayload, kv: torch.Tensor | None = None) -> tuple:
    return p.fingerprint, p.token_ids, p.first_token, p.sampling, p.kv if kv is None else kv


def engine_config(dtype: str, max_len: int, args) -> EngineConfig:
    return EngineConfig(
        model=MODEL,
        dtype=dtype,
        block_size=args.block_size,
        num_kv_blocks=4 * (max_len // args.block_size + 2),
        max_num_batched_tokens=max_len,
        max_num_seqs=4,
        torch_threads=args.threads,
        kv_stream="whole",  # the hand-off timed here (benchmarks/kv_stream.py compares it with "layer")
        enable_prefix_caching=False,  # the prefill repeats one prompt: each must compute it all
    )


async def serve_decode(args) -> None:
    """Child process of ``--decode-process``: a decode worker; prints its address, stops at stdin EOF."""
    server = await decode.serve(engine_config(args.dtypes, int(args.lengths), args))
    print(server.address, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop()


def start_decode_process(dtype: str, max_len: int, args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve-decode", "--dtypes", dtype, "--lengths", str(max_len)]
    cmd += ["--block-size", str(args.block_size)] + (["--threads", str(args.threads)] if args.threads else [])
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = child.stdout.readline().strip()
    if not address:
        child.kill()
        raise RuntimeError(f"decode worker process failed to start: {' '.join(cmd)}")
    return child, address


async def run_dtype(dtype: str, lengths: list[int], args) -> list[dict]:
    max_len = max(lengths)
    cfg = engine_config(dtype, max_len, args)
    engine = await asyncio.to_thread(LLMEngine, cfg)
    server = await decode.serve(cfg)
    child, e2e_address = start_decode_process(dtype, max_len, args) if args.decode_process else (None, server.address)
    rows, rng = [], random.Random(0)
    try:
        for n in lengths:
            ids = [rng.randrange(3, engine.model_cfg.vocab_size) for _ in range(n)]
            prefill_ms, seq = float("inf"), None
            for i in range(args.prefill_repeats):
                if seq is not None:
                    engine.scheduler.finish(seq)
                seq, ms = prefill(engine, f"p{n}-{i}", ids)
                prefill_ms = min(prefill_ms, ms)
            runner = engine.runner
            kv = runner.read_kv(seq, n)
            payload = KvPayload(seq.request_id, engine.fingerprint, ids, seq.token_ids[-1], seq.sampling.to_dict(), kv)
            frame = pack_kv(payload)
            pbuf = getattr(prefill_mod.PrefillWorker(engine, None), "kv_buffers", None)  # the workers' own
            dbuf = getattr(server.worker, "kv_buffers", None)
            st = {
                "read": best_ms(read_stage(runner, seq, n, pbuf), args.repeats),
                "pack": best_ms(functools.partial(SERIALIZE, payload), args.repeats),
                "unpack": best_ms(unpack_stage(frame, engine.fingerprint, dbuf), args.repeats),
            }
            write = functools.partial(write_ms, kv=kv, ids=ids, repeats=args.repeats)
            st["write"] = await asyncio.wrap_future(server.worker.host.loop.submit(write))
            nbytes = kv.numel() * kv.element_size()
            for transport in args.transports.split(","):
                st["push"], e2e = await handoffs(n, seq, payload, engine, server, e2e_address, transport, args)
                row = dict(dtype=dtype, tokens=n, transport=transport, bytes=nbytes, **st, e2e=e2e)
                row |= dict(gbps=nbytes / e2e / 1e6, prefill=prefill_ms)
                rows.append({**row, "share": e2e / (prefill_ms + e2e)})
                print_row(rows[-1])
            engine.scheduler.finish(seq)
    finally:
        await server.stop()
        if child is not None:
            child.stdin.close()
            child.wait(30)
    return rows


HEADER = (
    f"{'dtype':<9}{'tokens':>7}{'via':>6}{'MB':>8}{'read':>8}{'pack':>8}{'push':>8}{'unpack':>8}{'write':>8}"
    f"{'e2e ms':>9}{'GB/s':>7}{'prefill':>9}{'TTFT%':>7}"
)


def print_row(r: dict) -> None:
    print(
        f"{r['dtype']:<9}{r['tokens']:>7}{r['transport']:>6}{r['bytes'] / 1e6:>8.1f}{r['read']:>8.2f}{r['pack']:>8.2f}"
        f"{r['push']:>8.2f}{r['unpack']:>8.2f}{r['write']:>8.2f}{r['e2e']:>9.2f}{r['gbps']:>7.2f}"
        f"{r['prefill']:>9.1f}{r['share'] * 100:>6.1f}%",
        flush=True,
    )


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,1024,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=positive_int, default=10, help="N of min-of-N for every hand-off stage")
    p.add_argument("--prefill-repeats", type=positive_int, default=3, help="N of min-of-N for the prefill")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--chunk-bytes", type=int, default=0, help="gRPC's KV chunk size (default: GrpcKvSender's)")
    p.add_argument("--transports", default="grpc,tcp", help="KV transports to time, comma-separated: grpc, tcp")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--decode-process", action="store_true", help="e2e to a decode worker in a child process")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--serve-decode", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    checks = (("--transports", args.transports, ("grpc", "tcp")), ("--dtypes", args.dtypes, KV_DTYPES))
    for flag, value, allowed in checks:
        if not set(value.split(",")) <= set(allowed):
            p.error(f"{flag}: each of {', '.join(allowed)}; got {value!r}")
    if not all(x.strip().isdigit() and int(x) > 0 for x in args.lengths.split(",")):
        p.error(f"--lengths: positive numbers of tokens, comma-separated; got {args.lengths!r}")
    args.transports = ",".join(dict.fromkeys(args.transports.split(",")))  # each once
    if args.serve_decode:
        await serve_decode(args)
        return 0
    ctx = ModelConfig.from_folder(resolve_model_dir(MODEL)).max_position_embeddings
    lengths = [min(int(x), ctx - 2) for x in args.lengths.split(",")]  # capped at the context (printed)
    where = "a decode worker process" if args.decode_process else "this process"
    print(
        f"{MODEL}, block_size {args.block_size}, min of {args.repeats} (prefill: {args.prefill_repeats}); "
        f"stage times in ms; e2e to {where}; lengths {lengths} (the context holds {ctx})",
        flush=True,
    )
    print(HEADER)
    rows = []
    for dtype in args.dtypes.split(","):
        rows += await run_dtype(dtype, lengths, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
