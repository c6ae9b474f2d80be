"""`python -m tests.cluster.netns_loads NAME=HOST:PORT ...`: for each line NAME read from stdin,
one JSON line on stdout with that decode worker's own load, read now over its gRPC port with
the cluster's secret: `{"num_running": N, "num_steps": S}` (S: engine steps that computed
tokens since the worker started) or `{"error": "..."}`. Run inside a lab host's namespace
(tests/netns.py's `spawn_piped`), so that gRPC's own threads are made there."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from duet.cluster.decode_client import DecodeClient


async def serve(addresses: dict[str, str]) -> None:
    clients = {name: DecodeClient(address) for name, address in addresses.items()}
    loop = asyncio.get_running_loop()
    try:
        while name := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            try:
                load = await clients[name].load(5.0)
                reply: dict[str, object] = {
                    "num_running": load.num_running,
                    "num_steps": sum(load.stats.iteration_token_counts),
                }
            except (grpc.aio.AioRpcError, KeyError) as e:
                reply = {"error": repr(e)}
            print(json.dumps(reply), flush=True)
    finally:
        for client in clients.values():
            await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns_loads")
    parser.add_argument("workers", nargs="+", metavar="NAME=HOST:PORT")
    args = parser.parse_args()
    asyncio.run(serve(dict(w.split("=", 1) for w in args.workers)))


if __name__ == "__main__":
    main()
