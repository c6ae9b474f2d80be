"""`python -m duet.decode_worker`: a decode worker as a process, without Ray. Serves gRPC and
prints `DUET_READY <host:port>` once it does; stops on SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.server import start_decode_server
from duet.decode_worker.worker import DecodeWorker
from duet.engine.heap import freeze_startup_heap


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m duet.decode_worker")
    parser.add_argument("--config", default="{}", help="DecodeWorkerConfig fields as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0: a free one")
    parser.add_argument("--name", default="decode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = DecodeWorkerConfig.from_kwargs(**json.loads(args.config))
    worker = DecodeWorker(config, args.name)
    freeze_startup_heap()
    asyncio.run(_serve(worker, args.host, args.port))


async def _serve(worker: DecodeWorker, host: str, port: int) -> None:
    server, bound = await start_decode_server(worker, host, port)
    print(f"DUET_READY {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(5)
    worker.shutdown()


if __name__ == "__main__":
    main()
