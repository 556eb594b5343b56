"""Shared ``python -m pdserve.<role>`` entry point: serve one worker until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal


def run_worker(description: str, serve, prog: str | None = None) -> None:
    """Parse engine flags + --host/--port, ``await serve(cfg, host, port)``, print the address,
    wait for SIGINT/SIGTERM and stop cleanly."""
    from pdserve.worker.flags import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        running = await serve(engine_config_from_args(args), args.host, args.port)
        print(f"{description} listening on {running.address}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await running.stop()

    asyncio.run(main())
