"""`python -m tests.cluster.netns_loads NAME=HOST:PORT=PID ...`: the decode workers' own loads,
read over their gRPC ports with the cluster's secret, for a test in another process. Run inside
a lab host's namespace (tests/netns.py's `spawn_piped`), so that gRPC's own threads are made
there. Commands are JSON lines on stdin, each answered by one JSON line on stdout:

- `{"cmd": "steps"}`: each worker's engine steps that computed tokens since it started;
- `{"cmd": "freeze", "before": {NAME: steps}, "min_steps": M, "max_steps": N, "timeout_s": S}`:
  poll every worker, all at once and as fast as they answer, until one runs a stream
  (`num_running`) after M to N steps since `before`; stop it (SIGSTOP) at once and answer
  `{"name", "num_running", "num_steps"}`. `{"error"}` when every worker went past N steps
  without one (the streams ran out of the window) or after S seconds.

The process raises its own priority: under a loaded machine's contention its polls must not
fall behind the workers' steps."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import grpc

from duet.cluster.decode_client import DecodeClient


class Workers:
    def __init__(self, workers: dict[str, tuple[str, int]]) -> None:
        self.clients = {name: DecodeClient(address) for name, (address, _) in workers.items()}
        self.pids = {name: pid for name, (_, pid) in workers.items()}

    async def loads(self) -> dict[str, tuple[int, int]]:
        """name -> (num_running, num_steps), every worker read at once."""
        replies = await asyncio.gather(*(c.load(5.0) for c in self.clients.values()))
        return {
            name: (load.num_running, sum(load.stats.iteration_token_counts))
            for name, load in zip(self.clients, replies, strict=True)
        }

    async def freeze(
        self, before: dict[str, int], min_steps: int, max_steps: int, timeout_s: float
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loads = await self.loads()
            for name, (running, steps) in loads.items():
                if running and min_steps <= steps - before[name] <= max_steps:
                    os.kill(self.pids[name], signal.SIGSTOP)
                    return {"name": name, "num_running": running, "num_steps": steps - before[name]}
            if all(steps - before[name] > max_steps for name, (_, steps) in loads.items()):
                return {"error": f"every worker went past {max_steps} steps unseen: {loads}"}
        return {"error": f"no worker ran a stream within {timeout_s} s: {await self.loads()}"}

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


async def serve(workers: Workers) -> None:
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        command = json.loads(line)
        try:
            if command["cmd"] == "steps":
                reply: Any = {name: steps for name, (_, steps) in (await workers.loads()).items()}
            else:
                reply = await workers.freeze(
                    command["before"],
                    command["min_steps"],
                    command["max_steps"],
                    command["timeout_s"],
                )
        except grpc.aio.AioRpcError as e:
            reply = {"error": repr(e)}
        print(json.dumps(reply), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns_loads")
    parser.add_argument("workers", nargs="+", metavar="NAME=HOST:PORT=PID")
    args = parser.parse_args()
    with contextlib.suppress(PermissionError):  # root in CI; elsewhere it polls at par
        os.nice(-10)
    specs = {}
    for spec in args.workers:
        name, address, pid = spec.split("=")
        specs[name] = (address, int(pid))

    async def run() -> None:
        workers = Workers(specs)
        try:
            await serve(workers)
        finally:
            await workers.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
