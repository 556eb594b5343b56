"""A gRPC stream across test_two_nodes.py's link, with pdserve's channel and server options
(``pdserve.rpc.server.GRPC_OPTIONS``), run inside one of its network namespaces.

    python _link_probe.py serve HOST:PORT          # streams a message every 0.2 s to each caller
    python _link_probe.py call HOST:PORT --timeout S

``call`` prints one line ``first`` at the first message, then one JSON object when the call ends:
``messages``, ``code`` (its status name, "OK" when it ended well) and ``ended_s`` (seconds since
the call started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from pdserve.rpc.server import GRPC_OPTIONS

METHOD = "/probe.Probe/Stream"


async def _stream(request: bytes, context) -> None:
    while True:
        yield b"x" * 1024
        await asyncio.sleep(0.2)


async def serve(address: str) -> None:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "probe.Probe", {"Stream": grpc.unary_stream_rpc_method_handler(_stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"cannot bind {address}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def call(address: str, timeout_s: float) -> dict:
    t0 = time.monotonic()
    messages, code = 0, "OK"
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as ch:
        try:
            async for _ in ch.unary_stream(METHOD)(b"", timeout=timeout_s):
                messages += 1
                if messages == 1:
                    print("first", flush=True)
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
    return {"messages": messages, "code": code, "ended_s": time.monotonic() - t0}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["serve", "call"])
    p.add_argument("address")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds: the call's deadline")
    args = p.parse_args()
    if args.mode == "serve":
        asyncio.run(serve(args.address))
    else:
        print(json.dumps(asyncio.run(call(args.address, args.timeout))), flush=True)
