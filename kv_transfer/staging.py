"""Staging buffers reused across transfers.

A transfer stages a request's blocks in one contiguous tensor on each side (the sender gathers
into it, the receiver receives into it). A fresh multi-MB CPU tensor page-faults on first touch,
which on a 2-core VM made the gather and the receive each take about twice as long as into
warm memory; a buffer reused from the pool has its pages already.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch


class StagingPool:
    """Flat byte buffers on one device, handed out by `take` and returned by `give`. Keeps the
    largest `max_idle` returned buffers (memory held while idle: at most `max_idle` times the
    largest transfer seen); a buffer never given back (e.g. after a failed transfer, whose I/O
    may still touch it) is simply not reused. Thread-safe."""

    def __init__(self, device: torch.device, max_idle: int = 2) -> None:
        self.device = device
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # uint8, 1-D
        self._readers: dict[int, list[Any]] = {}  # id of an idle buffer -> its CUDA events

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` (contents undefined), viewing a pooled
        buffer; pass it back to `give` once no one reads or writes it any more."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
            # the smallest that fits (idle is sorted largest first)
            flat = self._idle.pop(fits[-1]) if fits else None
            readers = self._readers.pop(id(flat), []) if flat is not None else []
        for event in readers:  # CUDA: the last copies out of it have run
            event.synchronize()
        if flat is None:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return flat[:nbytes].view(dtype).view(shape)

    def take_parts(
        self, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Contiguous tensors of `shapes`, one after another in one pooled buffer (a transfer's
        target and draft layers); `give` any of them to return the whole buffer."""
        sizes = [torch.Size(shape).numel() for shape in shapes]
        flat = self.take((sum(sizes),), dtype)
        parts, offset = [], 0
        for shape, size in zip(shapes, sizes, strict=True):
            parts.append(flat[offset : offset + size].view(shape))
            offset += size
        return parts

    def give(self, tensor: torch.Tensor, readers: list[Any] | None = None) -> None:
        """Return a tensor from `take`: its whole buffer becomes idle. `readers`: CUDA events
        after the last reads queued on other streams; `take` waits for them before reuse."""
        whole = torch.empty(0, dtype=torch.uint8, device=self.device)
        whole.set_(tensor.untyped_storage())
        with self._lock:
            self._idle.append(whole)
            self._idle.sort(key=lambda b: b.numel(), reverse=True)
            for dropped in self._idle[self.max_idle :]:
                self._readers.pop(id(dropped), None)
            del self._idle[self.max_idle :]
            if readers:
                self._readers[id(whole)] = readers

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)


class StagingLease:
    """A receive buffer shared by a channel thread (receiving into it) and the inbox (copying
    out of it): back in the pool once both let go, unless the receive failed (the transport
    may still write into it)."""

    def __init__(self, pool: StagingPool, buf: torch.Tensor) -> None:
        self._pool, self._buf = pool, buf
        self._lock = threading.Lock()
        self._holders = 2
        self._reusable = True
        self._readers: list[Any] = []

    def release(self, reusable: bool = True) -> None:
        """On CUDA, the caller's stream may still have copies out of the buffer queued (the
        inbox's scatter): an event recorded on it now keeps the next receive from overwriting
        them. NOTE: the receive runs on the link's own stream, not the one that reads."""
        reader = None
        if self._buf.is_cuda:
            reader = torch.cuda.Event()
            reader.record()
        with self._lock:
            self._holders -= 1
            self._reusable = self._reusable and reusable
            if reader is not None:
                self._readers.append(reader)
            last = self._holders == 0
        if last and self._reusable:
            self._pool.give(self._buf, self._readers)


NCCL_COMM_BYTES = 256 << 20
"""Device memory budgeted per NCCL communicator (one per torch_dist channel: a prefill rank
has one per decode worker it sends to, a decode worker one per prefill rank): NCCL's
per-peer buffers (`NCCL_BUFFSIZE`, 4 MiB by default, per channel and direction) and its
internal state. An estimate: NCCL does not report it."""


def transfer_reservations(
    kv_backend: str,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    num_staged_requests: int,
    num_nccl_peers: int,
) -> dict[str, int]:
    """GPU memory (name -> bytes) a worker's KV pool sized from free memory leaves for KV
    transfer with caches on CUDA: staging buffers for `num_staged_requests` requests of
    `max_model_len` tokens (each side stages a whole request, in its own layout; the pool keeps
    two idle buffers, so budget at least two) and `num_nccl_peers` NCCL communicators
    (torch_dist, the backend for CUDA caches; "local" and "nixl" move blocks cache to cache,
    without either)."""
    if kv_backend in ("local", "nixl"):
        return {}
    blocks_per_request = -(-max_model_len // block_size)
    return {
        "kv_staging": num_staged_requests * blocks_per_request * block_bytes,
        "nccl": num_nccl_peers * NCCL_COMM_BYTES,
    }
