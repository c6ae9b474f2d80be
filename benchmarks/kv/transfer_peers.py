"""The two processes of the KV-transfer benchmark: a receiver (decode side) and a sender
(prefill side), each with its own paged cache, its endpoint of the measured backend
(`torch_dist`, `tcp`, `nixl` or `nixl-push`), one rank of a raw 2-rank gloo world for the
gloo baseline and, where NIXL is installed, a raw NIXL agent for the NIXL baseline
(`raw_nixl.py`). `benchmarks.kv.transfer` drives them over pipes, one command at a time, so
every timestamp below is taken inside the peer that does the work.

Timestamps are `time.monotonic()`, CLOCK_MONOTONIC on Linux: one clock for every process on
the machine, so the sender's start and the receiver's end of one transfer can be subtracted.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.kv.raw_nixl import RawNixl, raw_nixl_info
from duet.engine.cpu_runtime import keep_freed_memory

POLL_INTERVAL_S = 0.001  # what the decode and prefill workers wait between polls of KV
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LayoutSpec:
    """A model's paged-KV shape: one cache per layer, `[2, num_blocks, block_size, heads, dim]`."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" or "bfloat16"

    @property
    def block_bytes(self) -> int:
        """Bytes one block carries over the wire (K and V of every layer)."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


LAYOUTS = {
    spec.name: spec
    for spec in (
        LayoutSpec("smollm2-135m-fp32", 30, 3, 64, 16, "float32"),
        LayoutSpec("smollm2-135m-bf16", 30, 3, 64, 16, "bfloat16"),
        LayoutSpec("llama3-8b-bf16", 32, 8, 128, 16, "bfloat16"),
    )
}


@dataclass(frozen=True)
class PeerConfig:
    spec: LayoutSpec
    num_blocks: int  # the pool each side allocates
    timeout_s: float
    poll_interval_s: float = POLL_INTERVAL_S
    engine_malloc: bool = False  # the glibc settings CPU workers run with (engine/cpu_runtime.py)
    num_threads: int = 1  # torch threads per peer (gather and scatter)
    backend: str = "torch_dist"  # the duet KV backend measured (BACKENDS)
    tcp_stripes: int = 2  # connections per tcp channel (TcpKVSender's `stripes`)
    raw_nixl_bytes: int = 0  # each side's raw NIXL buffer (the largest transfer); 0: no baseline
    staging_bytes: int | None = None  # both sides' staging pool (None: the backend's default)
    device: str = "cpu"  # where the caches and the raw NIXL buffers live ("cuda": one GPU)
    copy_baseline: bool = False  # the receiver times a copy of the same bytes on `device`

    @property
    def backend_name(self) -> str:
        """The backend's registered name (`nixl-push` is `nixl` in push mode)."""
        return "nixl" if self.backend == "nixl-push" else self.backend

    def options(self, side: str) -> dict[str, Any]:
        """The backend's options on `side` ("sender" or "receiver") beyond the settings."""
        options: dict[str, Any] = {}
        if self.staging_bytes is not None:
            options["staging_bytes"] = self.staging_bytes
        if side == "sender" and self.backend == "tcp":
            options["stripes"] = self.tcp_stripes
        if side == "sender" and self.backend_name == "nixl":
            options["mode"] = "push" if self.backend == "nixl-push" else "pull"
        return options


BACKENDS = ("torch_dist", "tcp", "nixl", "nixl-push")
"""What the benchmark measures: duet's backends, and nixl in push mode (`nixl` pulls)."""


def block_value(layer: int, kv: int, block: torch.Tensor) -> torch.Tensor:
    """The value every element of the sender's block holds: small integers, exact in bf16, so
    the receiver can check what landed without a copy of the sender's cache."""
    return ((layer * 31 + kv * 3 + block * 7) % 251 + 1).float()


def _make_caches(config: PeerConfig, fill: bool) -> list[torch.Tensor]:
    spec = config.spec
    shape = (2, config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    # zeros, not empty: every page is touched once here, as an engine's pool is at start-up
    dtype, device = getattr(torch, spec.dtype), torch.device(config.device)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    if fill:
        blocks = torch.arange(config.num_blocks, device=device)
        for layer, cache in enumerate(caches):
            for kv in range(2):
                cache[kv].copy_(
                    block_value(layer, kv, blocks).view(-1, 1, 1, 1).expand_as(cache[kv])
                )
    return caches


def _check_blocks(caches: list[torch.Tensor], dst_ids: list[int], src_ids: list[int]) -> bool:
    device = caches[0].device
    dst, src = torch.tensor(dst_ids, device=device), torch.tensor(src_ids, device=device)
    for layer, cache in enumerate(caches):
        for kv in range(2):
            want = block_value(layer, kv, src).view(-1, 1, 1, 1).to(cache.dtype)
            if not torch.equal(cache[kv, dst], want.expand(-1, *cache.shape[2:])):
                return False
    return True


def _timed_copy(bufs: list[torch.Tensor], nbytes: int) -> float:
    """Seconds to copy `nbytes` from `bufs[0]` into `bufs[1]` (same device; a GPU is
    synchronised before and after): the copy limit a transfer between two caches there has."""
    src, dst = bufs[0][:nbytes], bufs[1][:nbytes]
    cuda = src.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(src.device)
    start = time.monotonic()
    dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(src.device)
    return time.monotonic() - start


def _cpu_s() -> float:
    return time.process_time()  # every thread of this process


def _raw_world(rank: int, port: int, timeout_s: float) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("raw", store),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _setup(config: PeerConfig) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(config.num_threads)
    if config.engine_malloc:
        keep_freed_memory()  # as the engine does at start (engine/cpu_runtime.py)


def _serve(conn: Connection, role: str, handle: Any) -> None:
    """Answer commands until "stop"; any exception goes back to the driver as text."""
    try:
        while True:
            command = conn.recv()
            if command[0] == "stop":
                conn.send(("ok", None))
                return
            handle(*command)
    except Exception:
        conn.send(("error", f"{role}: {traceback.format_exc()}"))


def run_receiver(conn: Connection, config: PeerConfig) -> None:
    """Decode side: hosts the backend's receiver and the raw world's store (rank 1)."""
    try:
        _setup(config)
        import torch.distributed as dist

        from duet.kv_transfer import KVLayout, TransferResult, TransferStatus, create_receiver

        caches = _make_caches(config, fill=False)
        layout = KVLayout.of_caches(config.spec.name, caches, config.spec.num_kv_heads)
        receiver: Any = create_receiver(
            config.backend_name,
            kv_caches=caches,
            layout=layout,
            timeout_s=config.timeout_s,
            **config.options("receiver"),
        )
        raw_nixl = (
            RawNixl("recv", config.raw_nixl_bytes, config.device) if config.raw_nixl_bytes else None
        )
        raw_store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.timeout_s),
        )
        info = {"address": receiver.address, "raw_port": raw_store.port}
        conn.send(("ok", {**info, "raw_nixl": raw_nixl_info(raw_nixl)}))
        _raw_world(1, raw_store.port, config.timeout_s)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", f"receiver: {traceback.format_exc()}"))
        return
    raw_buf: list[torch.Tensor] = []
    copy_bufs: list[torch.Tensor] = []

    def handle(op: str, *args: Any) -> None:
        if op == "raw_buffer":  # allocated and touched outside any timing
            (nbytes,) = args
            raw_buf[:] = [torch.zeros(nbytes, dtype=torch.uint8)]
            if config.copy_baseline:
                device = torch.device(config.device)
                copy_bufs[:] = [torch.ones(nbytes, dtype=torch.uint8, device=device),
                                torch.zeros(nbytes, dtype=torch.uint8, device=device)]  # fmt: skip
            conn.send(("ok", raw_buf[0].nbytes))
        elif op == "raw_copy":
            (nbytes,) = args
            cpu0 = _cpu_s()
            seconds = _timed_copy(copy_bufs, nbytes)
            conn.send(("ok", {"s": seconds, "cpu_s": _cpu_s() - cpu0}))
        elif op == "duet":
            request_id, dst_ids, check_src_ids = args
            if check_src_ids is not None:  # a checked rep must find its own data, not an old one
                for cache in caches:
                    cache[:, dst_ids] = 0
            cpu0 = _cpu_s()
            receiver.expect(request_id, dst_ids, config.timeout_s)
            conn.send(("ok", "armed"))
            deadline = time.monotonic() + config.timeout_s
            results: list[TransferResult] = []
            while not results and time.monotonic() < deadline:
                results = receiver.poll()
                if not results:
                    time.sleep(config.poll_interval_s)
            done_s = time.monotonic()
            cpu_s = _cpu_s() - cpu0
            if [r.status for r in results] != [TransferStatus.DONE]:
                raise RuntimeError(f"transfer {request_id}: {results or 'timed out'}")
            ok = None if check_src_ids is None else _check_blocks(caches, dst_ids, check_src_ids)
            conn.send(("ok", {"done_s": done_s, "cpu_s": cpu_s, "data_ok": ok}))
        elif op == "raw":
            (tag,) = args
            cpu0 = _cpu_s()
            work = dist.irecv(raw_buf[0], src=0, tag=tag)
            assert work is not None  # a member of the world
            conn.send(("ok", "armed"))
            work.wait()
            done_s = time.monotonic()
            conn.send(("ok", {"done_s": done_s, "cpu_s": _cpu_s() - cpu0}))
        elif op == "raw_nixl":
            (tag,) = args
            assert raw_nixl is not None
            cpu0 = _cpu_s()
            conn.send(("ok", "armed"))
            raw_nixl.wait(tag, config.timeout_s)
            done_s = time.monotonic()
            conn.send(("ok", {"done_s": done_s, "cpu_s": _cpu_s() - cpu0}))
        else:
            raise ValueError(f"unknown command {op!r}")

    try:
        _serve(conn, "receiver", handle)
    finally:
        receiver.close()
        if raw_nixl is not None:
            raw_nixl.close()


def run_sender(
    conn: Connection,
    config: PeerConfig,
    address: str,
    raw_port: int,
    raw_nixl_peer: dict[str, Any] | None = None,
) -> None:
    """Prefill side: the backend's sender (its channel opened before any timing), rank 0 of
    the raw world and, given the receiver's `raw_nixl_info`, the raw NIXL writer."""
    try:
        _setup(config)
        import torch.distributed as dist

        from duet.kv_transfer import KVLayout, TransferResult, TransferStatus, create_sender

        caches = _make_caches(config, fill=True)
        layout = KVLayout.of_caches(config.spec.name, caches, config.spec.num_kv_heads)
        sender: Any = create_sender(
            config.backend_name,
            kv_caches=caches,
            layout=layout,
            name="bench",
            timeout_s=config.timeout_s,
            ack_timeout_s=config.timeout_s,
            **config.options("sender"),
        )
        sender.connect(address)  # the handshake is a one-off per pair of workers: not timed
        _raw_world(0, raw_port, config.timeout_s)
        raw_nixl = None
        if raw_nixl_peer is not None:
            raw_nixl = RawNixl("send", config.raw_nixl_bytes, config.device)
            raw_nixl.connect(raw_nixl_peer["metadata"], raw_nixl_peer["address"])
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", f"sender: {traceback.format_exc()}"))
        return
    raw_buf: list[torch.Tensor] = []

    def handle(op: str, *args: Any) -> None:
        if op == "raw_buffer":
            (nbytes,) = args
            raw_buf[:] = [torch.ones(nbytes, dtype=torch.uint8)]
            conn.send(("ok", raw_buf[0].nbytes))
        elif op == "duet":
            request_id, src_ids = args
            cpu0 = _cpu_s()
            start_s = time.monotonic()
            sender.send(request_id, src_ids, address)
            returned_s = time.monotonic()
            deadline = returned_s + config.timeout_s
            results: list[TransferResult] = []
            while not results and time.monotonic() < deadline:
                results = sender.poll()
                if not results:
                    time.sleep(config.poll_interval_s)
            acked_s = time.monotonic()
            if [r.status for r in results] != [TransferStatus.DONE]:
                raise RuntimeError(f"transfer {request_id}: {results or 'no ack'}")
            reply = {"start_s": start_s, "returned_s": returned_s, "acked_s": acked_s}
            conn.send(("ok", {**reply, "cpu_s": _cpu_s() - cpu0, "chunks": results[0].num_chunks}))
        elif op == "raw":
            (tag,) = args
            cpu0 = _cpu_s()
            start_s = time.monotonic()
            dist.send(raw_buf[0], dst=1, tag=tag)
            conn.send(("ok", {"start_s": start_s, "cpu_s": _cpu_s() - cpu0}))
        elif op == "raw_nixl":
            nbytes, tag = args
            assert raw_nixl is not None
            cpu0 = _cpu_s()
            start_s = time.monotonic()
            raw_nixl.write(nbytes, tag, config.timeout_s)
            conn.send(("ok", {"start_s": start_s, "cpu_s": _cpu_s() - cpu0}))
        else:
            raise ValueError(f"unknown command {op!r}")

    try:
        _serve(conn, "sender", handle)
    finally:
        sender.close()
        if raw_nixl is not None:
            raw_nixl.close()


def spec_dict(spec: LayoutSpec) -> dict[str, Any]:
    return {**asdict(spec), "block_bytes": spec.block_bytes}
