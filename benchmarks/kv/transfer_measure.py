"""The measuring half of `benchmarks.kv.transfer`: spawns the receiver and sender peers of one
layout and drives them, rep by rep, through duet transfers and raw sends of the same size (a
gloo send, and a NIXL write where the peers have a NIXL baseline)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import statistics
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common.cpu_usage import CpuSnapshot, wait_for_idle
from benchmarks.kv.transfer_peers import (
    POLL_INTERVAL_S,
    LayoutSpec,
    PeerConfig,
    run_receiver,
    run_sender,
    spec_dict,
)
from duet.engine.block_pool import EVICTION_WINDOW, BlockPool, KVCacheBlock

NOISY_OTHER_CORES = 0.2
CHURN_STEPS = 3000
CHURN_MAX_PROMPT_BLOCKS = 128
EXTRA_POOL_BLOCKS = 44  # the pool is a little larger than the largest transfer


def _start_quiet(proc: Any) -> None:
    """Start a peer with c10d's warnings off: an idle channel's blocking store read times out
    every second by design and c10d logs each one (the peers report their own errors)."""
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # read by the child's torch at import
    try:
        proc.start()
    finally:
        if saved is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = saved


def _reply(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from a benchmark peer within {timeout_s:.0f} s")
    status, payload = conn.recv()
    if status == "error":
        raise RuntimeError(payload)
    return payload


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class _Peers:
    """The receiver and sender processes of one layout, driven one command at a time."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        self.recv_conn, child = ctx.Pipe()
        self.procs = [ctx.Process(target=run_receiver, args=(child, config), daemon=True)]
        _start_quiet(self.procs[0])
        self.send_conn: Connection | None = None
        try:
            info = _reply(self.recv_conn, config.timeout_s + 60)
            self.send_conn, child = ctx.Pipe()
            sender = ctx.Process(
                target=run_sender,
                args=(child, config, info["address"], info["raw_port"], info["raw_nixl"]),
                daemon=True,
            )
            self.procs.append(sender)
            _start_quiet(sender)
            _reply(self.send_conn, config.timeout_s + 60)
            _reply(self.recv_conn, config.timeout_s + 60)
        except BaseException:
            self.close()
            raise
        self.tag = 0

    def ask(self, conn: Connection | None, *command: Any) -> Any:
        assert conn is not None
        conn.send(command)
        return _reply(conn, self.config.timeout_s + 30)

    def raw_buffers(self, nbytes: int) -> None:
        for conn in (self.recv_conn, self.send_conn):
            if self.ask(conn, "raw_buffer", nbytes) != nbytes:
                raise RuntimeError(f"raw buffer is not {nbytes} bytes")

    def duet(
        self, request_id: str, src_ids: list[int], dst_ids: list[int], check: bool
    ) -> dict[str, Any]:
        self.ask(self.recv_conn, "duet", request_id, dst_ids, src_ids if check else None)
        before = CpuSnapshot.take(0.0)
        sent = self.ask(self.send_conn, "duet", request_id, src_ids)
        done = _reply(self.recv_conn, self.config.timeout_s + 30)
        own_s = sent["cpu_s"] + done["cpu_s"]
        usage = CpuSnapshot.take(own_s).usage_since(before, sent["acked_s"] - sent["start_s"])
        if check and not done["data_ok"]:
            raise RuntimeError(f"{request_id}: the receiver's blocks do not hold the sent data")
        return {
            "done_s": done["done_s"] - sent["start_s"],
            "ack_s": sent["acked_s"] - sent["start_s"],
            "send_call_s": sent["returned_s"] - sent["start_s"],
            "cpu_s": own_s,
            "own_cores": usage["own_cores"],
            "other_cores": usage["other_cores"],
            "checked": check,
            "chunks": sent["chunks"],
        }

    def raw(self, nbytes: int, via: str = "gloo") -> dict[str, Any]:
        """One raw transfer of `nbytes` (the size `raw_buffers` made, for gloo): a gloo send,
        or (`via="nixl"`) a NIXL write of one contiguous buffer."""
        self.tag += 1
        if via == "nixl":
            self.ask(self.recv_conn, "raw_nixl", self.tag)
            before = CpuSnapshot.take(0.0)
            sent = self.ask(self.send_conn, "raw_nixl", nbytes, self.tag)
        else:
            self.ask(self.recv_conn, "raw", self.tag)
            before = CpuSnapshot.take(0.0)
            sent = self.ask(self.send_conn, "raw", self.tag)
        done = _reply(self.recv_conn, self.config.timeout_s + 30)
        wall_s = done["done_s"] - sent["start_s"]
        own_s = sent["cpu_s"] + done["cpu_s"]
        usage = CpuSnapshot.take(own_s).usage_since(before, wall_s)
        return {
            "s": wall_s,
            "cpu_s": own_s,
            "own_cores": usage["own_cores"],
            "other_cores": usage["other_cores"],
        }

    def copy(self, nbytes: int) -> dict[str, Any]:
        """The receiver's copy of `nbytes` between two buffers on its device (the limit of a
        cache-to-cache move there: on a GPU, the device-to-device copy)."""
        before = CpuSnapshot.take(0.0)
        done = self.ask(self.recv_conn, "raw_copy", nbytes)
        usage = CpuSnapshot.take(done["cpu_s"]).usage_since(before, done["s"])
        return {**done, "own_cores": usage["own_cores"], "other_cores": usage["other_cores"]}

    def close(self) -> None:
        for conn in (self.send_conn, self.recv_conn):
            if conn is None:
                continue
            try:
                conn.send(("stop",))
                _reply(conn, 30)
            except (OSError, EOFError, RuntimeError, TimeoutError):
                pass  # a peer that already died: terminated below
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)


def default_pool_blocks(block_counts: list[int], block_order: str) -> int:
    """Each side's cache: a little more than the largest transfer, or with `--block-order
    pool` four times it (and room for the churn's largest prompt beside it), so the churn
    before a transfer has other requests' blocks to mix in."""
    if block_order == "pool":
        return max(4 * max(block_counts), max(block_counts) + CHURN_MAX_PROMPT_BLOCKS)
    return max(block_counts) + EXTRA_POOL_BLOCKS


def pool_problem(pool: int, block_counts: list[int], block_order: str) -> str | None:
    """Why a pool of `pool` blocks cannot serve these transfers in this order, or None."""
    if max(block_counts) > pool:
        return f"--pool-blocks: {pool} is smaller than the largest transfer"
    need = max(block_counts) + CHURN_MAX_PROMPT_BLOCKS
    if block_order == "pool" and pool < need:
        return (
            f"--pool-blocks: {pool} leaves no room for churn beside {max(block_counts)} blocks "
            f"(need >= {need})"
        )
    return None


def churned_table(
    pool: int, num_blocks: int, rng: random.Random, eviction_window: int = EVICTION_WINDOW
) -> list[int]:
    """A block table as duet's allocator (engine/block_pool.py) hands it out after churn:
    `CHURN_STEPS` random steps of prompts taking 1-128 blocks at once, running requests growing
    by a block, and requests finishing (freed tail-first, as the engine frees them), always
    leaving room for the transfer; then the transfer's `num_blocks`."""
    if problem := pool_problem(pool, [num_blocks], "pool"):
        raise ValueError(problem)
    blocks = BlockPool(pool, enable_caching=False, eviction_window=eviction_window)
    running: list[list[KVCacheBlock]] = []
    for _ in range(CHURN_STEPS):
        step = rng.random()
        room = blocks.num_free_blocks - num_blocks
        if running and (step < 0.3 or room < CHURN_MAX_PROMPT_BLOCKS):
            blocks.free_blocks(reversed(running.pop(rng.randrange(len(running)))))
        elif running and step < 0.7:
            if room > 0:
                running[rng.randrange(len(running))].extend(blocks.get_new_blocks(1))
        else:
            running.append(blocks.get_new_blocks(rng.randint(1, CHURN_MAX_PROMPT_BLOCKS)))
    return [block.block_id for block in blocks.get_new_blocks(num_blocks)]


def block_tables(
    pool: int, num_blocks: int, seed: int, order: str = "random"
) -> tuple[list[int], list[int]]:
    """The sender's and the receiver's block ids. `random`: distinct ids in no order (the
    worst case: no two rows of a layer next to each other); `runs`: as a fresh pool hands them
    out (one run of consecutive ids each, at a random start); `pool`: as duet's allocator hands
    them out after churn (`churned_table`), each side its own history."""
    rng = random.Random(seed * 1_000_003 + num_blocks)
    if order == "pool":
        return churned_table(pool, num_blocks, rng), churned_table(pool, num_blocks, rng)
    if order == "runs":
        src, dst = (rng.randrange(pool - num_blocks + 1) for _ in range(2))
        return list(range(src, src + num_blocks)), list(range(dst, dst + num_blocks))
    return rng.sample(range(pool), num_blocks), rng.sample(range(pool), num_blocks)


def measure_blocks(
    peers: _Peers, num_blocks: int, reps: int, warmup: int, seed: int, order: str = "random"
) -> dict[str, Any]:
    """`warmup` + `reps` interleaved duet and raw transfers of `num_blocks` blocks: each rep
    one of each kind, the order rotating from rep to rep (so the machine's noise and any
    after-effect of one kind on the next hit every kind alike)."""
    spec, pool = peers.config.spec, peers.config.num_blocks
    nbytes = num_blocks * spec.block_bytes
    peers.raw_buffers(nbytes)
    src_ids, dst_ids = block_tables(pool, num_blocks, seed, order)
    kinds = ["duet", "raw"] + (["raw_nixl"] if peers.config.raw_nixl_bytes else [])
    kinds += ["raw_copy"] if peers.config.copy_baseline else []
    taken: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    total = warmup + reps
    for rep in range(total):
        check = rep == 0 or rep == total - 1
        shift = rep % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            if kind == "duet":
                result = peers.duet(f"n{num_blocks}-rep{rep}", src_ids, dst_ids, check)
            elif kind == "raw_copy":
                result = peers.copy(nbytes)
            else:
                result = peers.raw(nbytes, "nixl" if kind == "raw_nixl" else "gloo")
            if rep >= warmup:
                taken[kind].append(result)
    duet_reps, raw_reps, nixl_reps = taken["duet"], taken["raw"], taken.get("raw_nixl", [])
    done = _stats([r["done_s"] for r in duet_reps])
    ack = _stats([r["ack_s"] for r in duet_reps])
    raw_s = _stats([r["s"] for r in raw_reps])
    nixl_s = _stats([r["s"] for r in nixl_reps]) if nixl_reps else None
    copy_reps = taken.get("raw_copy", [])
    copy_s = _stats([r["s"] for r in copy_reps]) if copy_reps else None
    other = [r["other_cores"] for r in duet_reps + raw_reps + nixl_reps + copy_reps]
    reps_out: list[dict[str, Any]] = [
        {"duet": d, "raw": r} for d, r in zip(duet_reps, raw_reps, strict=True)
    ]
    for rep_out, nixl in zip(reps_out, nixl_reps, strict=False):
        rep_out["raw_nixl"] = nixl
    for rep_out, copied in zip(reps_out, copy_reps, strict=False):
        rep_out["raw_copy"] = copied
    return {
        "num_blocks": num_blocks,
        "bytes": nbytes,
        "duet_done_s": done,
        "duet_ack_s": ack,
        "send_call_s": _stats([r["send_call_s"] for r in duet_reps]),
        "raw_s": raw_s,
        "duet_done_gbps": nbytes / done["median"] / 1e9,
        "duet_ack_gbps": nbytes / ack["median"] / 1e9,
        "raw_gbps": nbytes / raw_s["median"] / 1e9,
        "ratio_done": raw_s["median"] / done["median"],
        "ratio_ack": raw_s["median"] / ack["median"],
        # the raw NIXL write of one contiguous buffer (None without NIXL)
        "raw_nixl_s": nixl_s,
        "raw_nixl_gbps": nbytes / nixl_s["median"] / 1e9 if nixl_s else None,
        "ratio_done_nixl": nixl_s["median"] / done["median"] if nixl_s else None,
        # a copy of the same bytes within the receiver's device (None unless asked)
        "raw_copy_s": copy_s,
        "raw_copy_gbps": nbytes / copy_s["median"] / 1e9 if copy_s else None,
        "ratio_done_copy": copy_s["median"] / done["median"] if copy_s else None,
        "chunks": statistics.median(r["chunks"] for r in duet_reps),
        # CPU seconds of both processes per transfer: on a 2-core machine, the extra copies
        # (gather, scatter) compete with the transport for the same cores
        "duet_cpu_s": statistics.median(r["cpu_s"] for r in duet_reps),
        "raw_cpu_s": statistics.median(r["cpu_s"] for r in raw_reps),
        "raw_nixl_cpu_s": statistics.median(r["cpu_s"] for r in nixl_reps) if nixl_reps else None,
        "other_cores_median": statistics.median(other),
        "other_cores_max": max(other),
        "busy": statistics.median(other) > NOISY_OTHER_CORES,
        "reps": reps_out,
    }


def measure_layout(
    spec: LayoutSpec,
    block_counts: list[int],
    reps: int = 10,
    warmup: int = 2,
    *,
    pool_blocks: int | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
    poll_interval_s: float = POLL_INTERVAL_S,
    engine_malloc: bool = False,
    num_threads: int = 1,
    idle_wait_s: float = 0.0,
    backend: str = "torch_dist",
    block_order: str = "random",
    tcp_stripes: int = 2,
    raw_nixl: bool = False,
    staging_bytes: int | None = None,
    device: str = "cpu",
    copy_baseline: bool = False,
    log: Any = None,
) -> dict[str, Any]:
    """Spawn the two peers for `spec` and `backend` (caches on `device`) and measure each
    block count, against a gloo send, `raw_nixl` a NIXL write and `copy_baseline` a copy on
    `device` of the same bytes; the layout's JSON."""
    log = log or functools.partial(print, flush=True)
    pool = pool_blocks or default_pool_blocks(block_counts, block_order)
    if problem := pool_problem(pool, block_counts, block_order):
        raise ValueError(problem)  # before any peer starts
    raw_nixl_bytes = max(block_counts) * spec.block_bytes if raw_nixl else 0
    config = PeerConfig(
        spec, pool, timeout_s, poll_interval_s, engine_malloc, num_threads, backend, tcp_stripes,
        raw_nixl_bytes, staging_bytes, device, copy_baseline,
    )  # fmt: skip
    results = []
    peers = _Peers(config)
    try:
        for num_blocks in block_counts:
            if idle_wait_s > 0 and (busy := wait_for_idle(idle_wait_s)) is not None:
                log(f"  machine still busy after {idle_wait_s:.0f} s ({busy:.2f} other cores)")
            load = os.getloadavg()
            log(
                f"  {spec.name} {backend} {num_blocks} blocks: "
                f"load average {load[0]:.2f} {load[1]:.2f}"
            )
            result = measure_blocks(peers, num_blocks, reps, warmup, seed, block_order)
            results.append({"load_avg_before": list(load), **result})
    finally:
        peers.close()
    return {
        "layout": spec_dict(spec),
        "backend": backend,
        "device": device,
        "block_order": block_order,
        "pool_blocks": pool,
        "staging_bytes": staging_bytes,
        "results": results,
    }
