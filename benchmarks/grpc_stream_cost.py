"""CPU per streamed message of grpc.aio on loopback, server and client side, for the two ways each
side can stream: the server ``yield``s or calls ``context.write``; the client iterates the call or
calls ``read()``. Messages are pdserve's own ``GenerateResponse`` chunks (one token, its text, usage),
32 streams at once, 64 messages each, 10 ms apart (a decode step), as a router streams to clients.

Run: ``python benchmarks/grpc_stream_cost.py`` (about half a minute). It prints microseconds of CPU
per message for each process (user + system, from /proc; Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import socket
import time
from pathlib import Path

import grpc

from pdserve.v1 import generate_pb2 as PB
from pdserve.v1 import generate_pb2_grpc as G

STREAMS, MESSAGES, STEP_S, ROUNDS = 32, 64, 0.01, 5


class Streamer(G.GenerateServiceServicer):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def Generate(self, request, context):
        usage = PB.Usage(prompt_tokens=256)
        for i in range(MESSAGES):
            usage.completion_tokens += 1
            msg = PB.GenerateResponse(chunk=PB.Chunk(token_ids=[i], text="ab", usage=usage))
            if self.mode == "write":
                await context.write(msg)
            else:
                yield msg
            await asyncio.sleep(STEP_S)


def _serve(mode: str, port: int, ready) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        G.add_GenerateServiceServicer_to_server(Streamer(mode), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def _client(port: int, mode: str, rounds: int) -> float:
    """CPU seconds this process spent receiving ``rounds`` x STREAMS streams."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = G.GenerateServiceStub(ch)

        async def one() -> int:
            call, n = stub.Generate(PB.GenerateRequest()), 0
            if mode == "read":
                while (await call.read()) is not grpc.aio.EOF:
                    n += 1
            else:
                async for _ in call:
                    n += 1
            assert n == MESSAGES
            return n

        t = time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(STREAMS)))
        return time.process_time() - t


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    print(f"machine: {_cpu_model()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}")
    messages = ROUNDS * STREAMS * MESSAGES
    for server_mode in ("yield", "write"):
        for client_mode in ("async-for", "read"):
            ready, port = mp.Event(), _free_port()
            proc = mp.Process(target=_serve, args=(server_mode, port, ready), daemon=True)
            proc.start()
            ready.wait(30)
            asyncio.run(_client(port, client_mode, 1))  # warm-up
            before = _cpu_s(proc.pid)
            client_s = asyncio.run(_client(port, client_mode, ROUNDS))
            server_s = _cpu_s(proc.pid) - before
            proc.kill()
            proc.join()
            print(
                f"server {server_mode:5s} client {client_mode:9s}: server {server_s / messages * 1e6:4.0f} us/message, "
                f"client {client_s / messages * 1e6:4.0f} us/message"
            )


if __name__ == "__main__":
    main()
