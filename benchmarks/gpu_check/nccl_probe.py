"""`make gpu-check`'s NCCL peer-loss probe: what happens to one side of a torch_dist channel's
link (kv_transfer/torch_dist/link.py) when its peer never joins, or dies after the first chunk.

For each case and each setting of `TORCH_NCCL_ASYNC_ERROR_HANDLING` (PyTorch's default, and
duet's `NCCL_ASYNC_ERROR_HANDLING`) a survivor process opens rank 0 of a link and sends 64 MiB
chunks, each posted on a thread of its own so that a post that blocks (NCCL builds its
communicator at the first operation, and waits there for its peer) is seen, not suffered. It
records: whether each post returned and each chunk's event completed within duet's transfer
timeout; whether `abort()` returned and unblocked a stuck post; and then it outlives the
watchdog's timeout (`WATCHDOG_FACTOR` transfer timeouts) by a margin, so the parent sees
whether PyTorch's watchdog killed it. The peer of the second case receives the first chunk and
exits without a word (`os._exit`), as a crashed worker would.

With one GPU the peer shares the survivor's device, which NCCL refuses (two ranks of one
communicator on one device): that case then records the refusal; it needs two GPUs. On the CPU
the same runs over NCCL's emulation on gloo (the tests), whose findings say nothing of NCCL.

    python -m benchmarks.gpu_check.nccl_probe survivor --case dies --device cuda:0 --timeout-s 4
    python -m benchmarks.gpu_check.nccl_probe peer --store-port P --device cuda:1 --timeout-s 4
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.processes import Child, child_env

CASES = ("never_joins", "dies")
HANDLING = ("default", "2")
CHUNK_BYTES = 64 << 20
"""Large enough that no transport buffers the whole chunk without the receiver posting (the
CPU tests send 1 MiB: gloo on a busy 2-core machine moves 64 MiB in about a second)."""
SURVIVE_MARGIN_S = 4.0
PEER_START_S = 60.0
"""How long the second case's survivor waits for its peer's process to start (imports)."""


def _timed_call(fn: Callable[[], Any], timeout_s: float, name: str) -> dict[str, Any]:
    """Run `fn` on a daemon thread; wait up to `timeout_s`. {returned, seconds, error, value}."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # recorded: the probe is about how things fail
            box["error"] = f"{type(e).__name__}: {e}"[:500]

    started = time.monotonic()
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return {
        "returned": not thread.is_alive(), "seconds": round(time.monotonic() - started, 3),
        "error": box.get("error"), "value": box.get("value"), "thread": thread,
    }  # fmt: skip


def _public(call: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in call.items() if k not in ("thread", "value")}


def survivor(
    case: str, device: torch.device, timeout_s: float, emulate: bool, chunk_bytes: int
) -> None:
    import torch.distributed as dist

    from duet.kv_transfer.torch_dist.link import WATCHDOG_FACTOR, open_link

    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=PEER_START_S),
                          wait_for_workers=False)  # fmt: skip
    print(f"PROBE_STORE {store.port}", flush=True)
    if case == "dies":  # both sides open the link together, as two live workers would
        store.wait(["peer_ready"])
    store.set_timeout(datetime.timedelta(seconds=timeout_s))  # duet's: the transfer timeout
    prefix = dist.PrefixStore("probe", store)
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "default")
    result: dict[str, Any] = {"case": case, "handling": handling, "device": str(device),
                              "timeout_s": timeout_s}  # fmt: skip
    opened = _timed_call(lambda: open_link(prefix, 0, device, timeout_s, emulate, "probe"),
                         2 * timeout_s, "open")  # fmt: skip
    result["open"] = _public(opened)
    link = opened["value"]
    stuck: list[threading.Thread] = []
    if link is not None:
        for index in (0, 1):
            chunk = torch.full((chunk_bytes // 4,), float(index), device=device)
            post = _timed_call(
                functools.partial(link.send, chunk, index), timeout_s, f"send{index}"
            )
            entry: dict[str, Any] = {"post": _public(post)}
            if post["returned"] and post["error"] is None:
                event = link.record()
                waited = _timed_call(
                    functools.partial(event.wait, timeout_s), 2 * timeout_s, "wait"
                )
                entry["completed"] = bool(waited["value"])
                entry["wait"] = _public(waited)
            else:
                entry["completed"] = False
                if not post["returned"]:
                    stuck.append(post["thread"])
            result[f"chunk{index}"] = entry
            if not entry["completed"]:
                break
        aborted = _timed_call(link.abort, timeout_s, "abort")
        result["abort"] = _public(aborted)
        for thread in stuck:
            thread.join(timeout_s)
        returned = [not t.is_alive() for t in stuck]
        result["stuck_posts_returned_after_abort"] = all(returned) if stuck else None
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    # Outlive the watchdog's timeout: the parent sees whether it tears this process down.
    time.sleep(WATCHDOG_FACTOR * timeout_s + SURVIVE_MARGIN_S)
    print("PROBE_SURVIVED", flush=True)
    os._exit(0)  # a post still stuck in NCCL would block a normal exit


def peer(
    store_port: int, device: torch.device, timeout_s: float, emulate: bool, chunk_bytes: int
) -> None:
    import torch.distributed as dist

    from duet.kv_transfer.torch_dist.link import open_link

    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", store_port, 2, False,
                          datetime.timedelta(seconds=timeout_s))  # fmt: skip
    store.set("peer_ready", "1")
    try:
        link = open_link(dist.PrefixStore("probe", store), 1, device, timeout_s, emulate, "peer")
        buf = torch.empty(chunk_bytes // 4, device=device)
        link.recv(buf, 0)
        got = link.record().wait(2 * timeout_s)
        print(f"PEER_FIRST_CHUNK {got}", flush=True)
    except BaseException as e:  # e.g. NCCL's refusal of two ranks on one GPU
        print(f"PEER_ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
    os._exit(3)  # dies without closing anything, as a crashed worker would


@dataclass
class _Run:
    case: str
    handling: str
    survivor: Child
    peer: Child | None = None


def run_probe(
    workdir: Path,
    deadline: float,
    timeout_s: float,
    emulate: bool,
    chunk_bytes: int = CHUNK_BYTES,
    handlings: tuple[str, ...] = HANDLING,
) -> dict[str, Any]:
    """Every case under every setting of `handlings` at once, each in its own processes; the
    findings. (The setting is NCCL's: the CPU tests run the default only.)"""
    num_gpus = torch.cuda.device_count() if not emulate else 0
    device = "cpu" if emulate else "cuda:0"
    peer_device = "cpu" if emulate else ("cuda:1" if num_gpus >= 2 else "cuda:0")
    flags = ["--timeout-s", str(timeout_s), "--chunk-bytes", str(chunk_bytes)]
    flags += ["--emulate"] if emulate else []
    loopback = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    module = ["-m", "benchmarks.gpu_check.nccl_probe"]
    runs = []
    for case in CASES:
        for handling in handlings:
            env = child_env(loopback)
            env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            if handling != "default":
                env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
            args = [*module, "survivor", "--case", case, "--device", device, *flags]
            log = workdir / f"survivor_{case}_{handling}.log"
            runs.append(_Run(case, handling, Child(args, log, env)))
    for run in runs:
        if run.case == "dies":
            port = run.survivor.wait_for_line(r"PROBE_STORE (\d+)", deadline)[1]
            args = [*module, "peer", "--store-port", port, "--device", peer_device, *flags]
            log = workdir / f"peer_{run.case}_{run.handling}.log"
            run.peer = Child(args, log, child_env(loopback))
    findings = []
    for run in runs:
        try:
            run.survivor.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # recorded as not having survived in time
            pass
        findings.append(_finding(run, timeout_s))
        run.survivor.stop()
        if run.peer is not None:
            run.peer.stop()
    return {
        "outcome": "recorded",
        "timeout_s": timeout_s,
        "chunk_bytes": chunk_bytes,
        "link": "nccl-emulated (gloo)" if emulate else "nccl",
        "num_gpus": num_gpus,
        "peer_device": peer_device,
        "note": None if emulate or num_gpus >= 2 else (
            "one GPU: the 'dies' case's peer shares the survivor's device, which NCCL refuses; "
            "its findings are of that refusal, and the case needs two GPUs"
        ),
        "cases": findings,
    }  # fmt: skip


def _finding(run: _Run, timeout_s: float) -> dict[str, Any]:
    text = run.survivor.text()
    match = re.search(r"PROBE_RESULT (.*)", text)
    result = json.loads(match[1]) if match else None
    peer_line = re.search(r"PEER_\w+ .*", run.peer.text()) if run.peer is not None else None
    # The first operation that did not finish: the link's opening (gloo waits for its peer
    # there), or a chunk's post (NCCL builds its communicator at the first one) or event.
    stalled = None
    if result is not None:
        opened = result["open"]
        if not opened["returned"] or opened["error"]:
            stalled = {"post": opened, "completed": False}
        else:
            chunks = [result.get(f"chunk{i}") for i in (0, 1)]
            stalled = next((c for c in chunks if c is not None and not c["completed"]), None)
    survived = "PROBE_SURVIVED" in text
    return {
        "case": run.case,
        "handling": run.handling,
        "result": result,
        "peer": peer_line[0] if peer_line else None,
        # the stalled operation gave control back within the transfer timeout (post + wait)
        "returned_within_timeout": None if stalled is None else (
            stalled["post"]["returned"] and stalled["post"]["seconds"] <= timeout_s + 1.0
        ),
        "abort_returned": None if result is None or "abort" not in result else
        result["abort"]["returned"],
        "stuck_posts_returned_after_abort": None if result is None else
        result.get("stuck_posts_returned_after_abort"),
        "survived_watchdog": survived,
        "exit_code": run.survivor.proc.poll(),
        "log_tail": None if survived else text[-1500:],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.nccl_probe")
    parser.add_argument("role", choices=["survivor", "peer"])
    parser.add_argument("--case", choices=CASES, default="dies")
    parser.add_argument("--store-port", type=int, default=0)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--timeout-s", type=float, default=4.0)
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES)
    parser.add_argument("--emulate", action="store_true", help="CPU: NCCL's emulation on gloo")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.role == "survivor":
        survivor(args.case, device, args.timeout_s, args.emulate, args.chunk_bytes)
    else:
        peer(args.store_port, device, args.timeout_s, args.emulate, args.chunk_bytes)


if __name__ == "__main__":
    main()
