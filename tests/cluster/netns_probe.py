"""`python -m tests.cluster.netns_probe`: what a host outside the cluster gets from its workers
(run in a network namespace that reaches them, with a cluster secret of its own). Prints one
JSON line: whether each port accepts a TCP connection, the status of each worker's `GetLoad`
signed with this process's secret, and the outcome of a KV transfer offered to the decode
worker's KV listener with it."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import grpc
import torch

from duet.cluster.decode_client import DecodeClient
from duet.cluster.prefill_client import PrefillClient
from duet.cluster_auth import load_cluster_secret
from duet.kv_transfer import KVLayout, create_sender


def reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


async def status_of(call) -> str:  # type: ignore[no-untyped-def]
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


async def rpcs(prefill: str, decode: str) -> dict[str, str]:
    p, d = PrefillClient(prefill), DecodeClient(decode)
    try:
        return {"prefill_get_load": await status_of(p.load(0, 5.0)),
                "decode_get_load": await status_of(d.load(5.0))}  # fmt: skip
    finally:
        await p.channel.close()
        await d.channel.close()


def offer_kv(kv_address: str) -> dict[str, object]:
    caches = [torch.zeros(2, 4, 8, 2, 16) for _ in range(2)]
    layout = KVLayout.of_caches("outsider", caches, 2, 1, 0)
    sender = create_sender("tcp", kv_caches=caches, layout=layout, name="outsider", timeout_s=5,
                           secret=load_cluster_secret())  # fmt: skip
    try:
        sender.send("outsider-1", [0, 1], kv_address)
        deadline = time.monotonic() + 20
        while not (results := sender.poll()):
            if time.monotonic() > deadline:
                return {"status": "no outcome in 20 s"}
            time.sleep(0.02)
        return {"status": results[0].status.name, "error": results[0].error}
    finally:
        sender.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns_probe")
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--kv", required=True)
    args = parser.parse_args()
    report: dict[str, object] = {
        "reach": {a: reachable(a) for a in (args.prefill, args.decode, args.kv)},
        **asyncio.run(rpcs(args.prefill, args.decode)),
        "kv": offer_kv(args.kv),
    }
    print("PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
