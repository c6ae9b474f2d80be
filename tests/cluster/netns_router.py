"""`python -m tests.cluster.netns_router`: a router as a process of its own (for the network
namespace fault tests): a `ClusterEngine` over the prefill and decode workers named on the
command line and the REST app over it (`make_app`: API key, the dashboard at /v1/dashboard),
served by uvicorn on `--host:--port`. Prints `DUET_READY <host:port>` once every worker has
reported healthy; stops on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

import uvicorn

from duet.cluster.config import ClusterConfig
from duet.cluster.engine import ClusterEngine
from tests.router.rest_server import API_KEY, MODEL_NAME, make_app


def _workers(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


async def serve(args: argparse.Namespace) -> None:
    prefill, decode = _workers(args.prefill), _workers(args.decode)
    engine = ClusterEngine(args.model, ClusterConfig(**json.loads(args.cluster)))
    engine.pool.set_workers(prefill, decode)
    await engine.start()
    try:
        while len(engine.pool.healthy_prefill()) < len(prefill) or len(
            engine.pool.healthy_decode()
        ) < len(decode):
            await asyncio.sleep(0.05)
        app = make_app(engine, MODEL_NAME, api_keys=[API_KEY])
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level="warning", timeout_graceful_shutdown=2))  # fmt: skip
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        print(f"DUET_READY {args.host}:{args.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    finally:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns_router")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", default=[], help="name=host:port")
    parser.add_argument("--decode", action="append", default=[], help="name=host:port")
    parser.add_argument("--cluster", default="{}", help="ClusterConfig fields as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
