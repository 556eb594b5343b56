"""Whole-frame against layer-wise KV hand-off in split placement: TTFT and the hand-off left exposed.

For each dtype and hand-off (``--kv-stream whole`` / ``layer``, over each ``--kv-transports``: the
KV data connection, ``tcp``, by default; ``grpc,tcp`` puts the two side by side) it starts a
prefill worker and a decode worker, each in a process of its own (``python -m
pdserve.prefill_worker`` / ``decode_worker``) pinned to CPUs of its own as ``pdserve serve
--placement split`` places them (one each by default, so the prefill worker's sending competes with
its forward on its core), and sends them prompts of each length the way the router does (Decode
first, then Prefill with the decode worker's address).
Per request:

- ``prefill``: from the Prefill call to the first token sampled (the prefill worker's wall clock,
  ``first_token_unix_ns``); layer-wise, this includes the copies and sends done during the forward.
- ``exposed``: from that first token to the decode worker admitting the sequence (its
  ``kv_transfer_ns``): the hand-off time not hidden behind the prefill.
- ``TTFT``: prefill + exposed, the time until decode can run (the earliest start of token 2).
- ``GB/s``: KV bytes / exposed, for the whole frame only: its whole hand-off on loopback (read out of
  the cache, pack, push, unpack, write, admit), a lower bound of the transfer rate.

Every prompt is new random tokens (no prefix-cache hits); the two hand-offs' workers run side by
side and take turns, request by request. Each row is the request of least TTFT of ``--repeats``
(after ``--warmup``; the machine may be shared), with the median TTFT beside it; the CPU model and
whether it has AMX are printed first.

    python benchmarks/kv_stream.py                     # 256 and 1,024 tokens, float32 and bfloat16
    python benchmarks/kv_stream.py --lengths 1024 --dtypes bfloat16 --repeats 15
    python benchmarks/kv_stream.py --kv-transports grpc,tcp  # each hand-off over both transports
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import grpc

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.loader import resolve_model_dir
from pdserve.v1 import worker_pb2, worker_pb2_grpc

MODEL = "embedded:llama-80m"


def cpu_line() -> str:
    """The CPU model name (lscpu), its core count and whether it has AMX (amx_tile in /proc/cpuinfo)."""
    name = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    amx = "with AMX" if " amx_tile" in flags else "without AMX"
    return f"{name}, {len(os.sched_getaffinity(0))} cores, {amx}"


def start_worker(role: str, dtype: str, mode: str, args) -> tuple[subprocess.Popen, str]:
    """A worker process; with ``--cpus-per-worker N`` pinned to CPUs of its own (prefill the first N,
    decode the next N) with N torch threads, as ``pdserve serve --placement split`` places them.
    ``mode``: "<kv stream>/<kv transport>"."""
    kv_stream, kv_transport = mode.split("/")
    cmd = [sys.executable, "-m", f"pdserve.{role}_worker", "--model", MODEL, "--dtype", dtype]
    cmd += ["--kv-stream", kv_stream, "--kv-transport", kv_transport, "--port", "0"]
    cmd += ["--max-num-batched-tokens", str(max(args.lengths))]
    n, pin = args.cpus_per_worker, None
    if n:
        cpus = sorted(os.sched_getaffinity(0))[(role == "decode") * n :][:n]
        cmd += ["--threads", str(n)]

        def pin():
            os.sched_setaffinity(0, cpus)

    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=pin)
    line = child.stdout.readline()
    if "listening on" not in line:
        child.kill()
        raise RuntimeError(f"{role} worker failed to start: {' '.join(cmd)}")
    return child, line.rsplit(" ", 1)[1].strip()


async def one_request(prefill, decode, decode_address: str, rid: str, ids: list[int]) -> dict:
    stream = decode.Decode(worker_pb2.DecodeRequest(request_id=rid, kv_timeout_s=60, prompt_token_ids=ids))
    await stream.initial_metadata()
    sampling = worker_pb2.ResolvedSampling(temperature=0.0, top_p=1.0, max_tokens=2, ignore_eos=True)
    t0 = time.time_ns()
    call = prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=sampling, decode_address=decode_address
        )
    )
    first = await call.read()
    batch = await stream.read()
    while (msg := await call.read()) is not grpc.aio.EOF:
        assert not msg.HasField("kv_push_error"), msg
    stream.cancel()
    t = batch.timings
    prefill_ms = (first.first_token_unix_ns - t0) / 1e6
    exposed_ms = t.kv_transfer_ns / 1e6
    return dict(prefill=prefill_ms, exposed=exposed_ms, ttft=prefill_ms + exposed_ms, nbytes=t.kv_transfer_bytes)


async def run(dtype: str, args) -> list[dict]:
    """Both hand-offs' workers at once (idle ones cost nothing), their requests interleaved, so that
    whatever else runs on the machine meanwhile slows both alike; rows whole, layer per length."""
    modes = tuple(f"{s}/{t}" for t in args.kv_transports.split(",") for s in ("whole", "layer"))
    procs = {m: (start_worker("prefill", dtype, m, args), start_worker("decode", dtype, m, args)) for m in modes}
    rows, rng = [], random.Random(0)
    vocab = ModelConfig.from_folder(resolve_model_dir(MODEL)).vocab_size
    channels = [grpc.aio.insecure_channel(addr) for m in modes for (_, addr) in procs[m]]
    try:
        stubs = {
            m: (
                worker_pb2_grpc.PrefillServiceStub(channels[2 * i]),
                worker_pb2_grpc.DecodeServiceStub(channels[2 * i + 1]),
            )
            for i, m in enumerate(modes)
        }
        for n in args.lengths:
            runs = {m: [] for m in modes}
            for i in range(args.warmup + args.repeats):
                ids = [rng.randrange(3, vocab) for _ in range(n)]
                for m in modes if i % 2 else modes[::-1]:
                    prefill, decode = stubs[m]
                    r = await one_request(prefill, decode, procs[m][1][1], f"{m}-{dtype}-{n}-{i}", ids)
                    if i >= args.warmup:
                        runs[m].append(r)
            for m in modes:
                best = min(runs[m], key=lambda r: r["ttft"])  # the request least disturbed by the machine's other work
                row = dict(dtype=dtype, kv_stream=m, tokens=n, **best)
                row["ttft_median"] = statistics.median(r["ttft"] for r in runs[m])
                row |= {f"{k}_runs": [round(r[k], 2) for r in runs[m]] for k in ("prefill", "exposed")}
                rows.append(row)
    finally:
        for channel in channels:
            await channel.close()
        for pair in procs.values():
            for child, _ in pair:
                child.terminate()
                child.wait(30)
    return rows


HEADER = (
    f"{'dtype':<9}{'tokens':>7}{'MB':>7}  {'hand-off':<11}{'prefill':>9}{'exposed':>9}{'TTFT':>9}{'exposed%':>9}"
    f"{'GB/s':>7}{'TTFT p50':>10}"
)


def print_row(r: dict) -> None:
    gbps = f"{r['nbytes'] / r['exposed'] / 1e6:>7.2f}" if r["kv_stream"][0] == "w" and r["exposed"] else f"{'-':>7}"
    print(
        f"{r['dtype']:<9}{r['tokens']:>7}{r['nbytes'] / 1e6:>7.1f}  {r['kv_stream']:<11}{r['prefill']:>9.1f}"
        f"{r['exposed']:>9.2f}{r['ttft']:>9.1f}{100 * r['exposed'] / r['ttft']:>8.1f}%{gbps}{r['ttft_median']:>10.1f}",
        flush=True,
    )


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="256,1024", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=9, help="requests per row (the best is printed)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--cpus-per-worker",
        type=int,
        default=1,
        help="pin each worker to this many CPUs of its own with as many torch threads (pdserve serve's "
        "default: 1); 0: no pinning, torch's default threads, both workers on every core",
    )
    p.add_argument("--kv-transports", default="tcp", help="the workers' --kv-transport, each in turn: tcp, grpc")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if not set(args.kv_transports.split(",")) <= {"tcp", "grpc"}:
        p.error(f"--kv-transports: each of tcp, grpc; got {args.kv_transports!r}")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    where = f"{args.cpus_per_worker} CPU(s) per worker" if args.cpus_per_worker else "workers share every core"
    print(f"{MODEL}; {cpu_line()}; {where}; best of {args.repeats} requests; times in ms", flush=True)
    print(HEADER)
    rows = []
    for dtype in args.dtypes.split(","):
        for row in await run(dtype, args):
            print_row(row)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
