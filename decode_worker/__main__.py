"""`python -m duet.decode_worker`: one rank of a decode worker as a process, without Ray. Rank 0
serves gRPC and prints `DUET_READY <host:port>` once it does, and stops on SIGINT or SIGTERM;
other ranks follow rank 0 and stop with it. With `data_parallel_size` D in the config, the
process is worker `--dp-rank` of a data-parallel group of D (meeting at `--dp-init-method`):
each serves gRPC as a worker of its own, and all stop when one does."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.launch import start_decode_rank
from duet.decode_worker.server import start_decode_server
from duet.decode_worker.worker import DecodeWorker
from duet.engine.heap import freeze_startup_heap
from duet.engine.peer_lockstep import until_stopped
from duet.engine.tp_group import exit_rank


def main() -> int:
    """The worker's exit code: 1 when its engine failed (a data-parallel peer killed, say),
    else 0."""
    parser = argparse.ArgumentParser(prog="python -m duet.decode_worker")
    parser.add_argument("--config", default="{}", help="DecodeWorkerConfig fields as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0: a free one")
    parser.add_argument("--name", default="decode")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-init-method", default=None, help="e.g. tcp://127.0.0.1:29500")
    parser.add_argument("--dp-rank", type=int, default=0, help="in a data-parallel group")
    parser.add_argument(
        "--dp-init-method", default=None, help="the data-parallel group's tcp://HOST:PORT"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = DecodeWorkerConfig.from_kwargs(**json.loads(args.config))
    if config.data_parallel_size > 1:
        worker = start_decode_rank(config, args.dp_rank, args.dp_init_method, args.name)
    else:
        worker = start_decode_rank(config, args.tp_rank, args.tp_init_method, args.name)
    freeze_startup_heap()
    if args.tp_rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # stops with rank 0, as prefill ranks do
        worker.join()
        return int(worker.failed)
    asyncio.run(_serve(worker, args.host, args.port))
    return int(worker.failed)


async def _serve(worker: DecodeWorker, host: str, port: int) -> None:
    server, bound = await start_decode_server(worker, host, port)
    print(f"DUET_READY {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await until_stopped(stop, lambda: worker.is_running)
    await server.stop(5)
    worker.shutdown()


if __name__ == "__main__":
    exit_rank(main())  # a rank of a group: see exit_rank
