"""The bounded staging pool a worker's torch_dist or tcp transfers stream through.

torch_dist gathers blocks into staging before a send and receives into staging before the
scatter; the tcp receiver stages what nobody expects yet and head shards from a sender with
larger TP. Every such buffer is a slot of one arena of `capacity_bytes`, allocated at first use
and kept (a fresh multi-MB CPU tensor page-faults on first touch, which on a 2-core VM made a
gather or a receive take about twice as long as into warm memory). A transfer moves piece by
piece (`kv_transfer/chunks.py`: at most `max_piece_bytes` each), taking a slot per piece and
giving it back once the piece is sent or scattered, so a transfer of any length uses at most
the pool, and a piece that finds no room waits for it (bounded by its transfer's timeout)
instead of allocating. The KV budget counts the arena (`transfer_reservations`).

An allocation that fails (the arena at first use) raises `StagingError`: the transfer that
asked fails (retryable) and the next one tries again; the worker carries on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

PIECES_PER_POOL = 4
"""A piece is at most this fraction of the pool, so a gather beside a send, a receive beside
a scatter and the pieces of a few transfers fit at once."""
SLOT_ALIGN = 256  # bytes: every slot starts at a multiple (any dtype's view, CUDA copies)
MIN_STAGING_BYTES = 1 << 20
MAX_STAGING_BYTES = 1 << 40
DEFAULT_STAGING_BYTES = 256 << 20
"""The default pool: 64 MiB pieces (NCCL moves messages that large at its peak rate), 2 ms of
a 128k-token Llama-3.1-8B layer at H100 NVLink speed; ~0.4% of an 80 GB GPU."""


class StagingError(RuntimeError):
    """No staging for a piece: the arena could not be allocated, or no room came within the
    transfer's timeout. Fails that transfer (retryable), never the worker."""


def check_staging_bytes(name: str, value: int) -> None:
    """ValueError naming `name` unless `value` is a whole number of bytes in range."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer number of bytes; got {value!r}")
    if not MIN_STAGING_BYTES <= value <= MAX_STAGING_BYTES:
        raise ValueError(
            f"{name}: must be in [{MIN_STAGING_BYTES}, {MAX_STAGING_BYTES}] bytes (1 MiB to "
            f"1 TiB); got {value}"
        )


class StagingPool:
    """Slots of one arena on `device`: `try_take`/`take` hand one out (first fit), `give`
    returns it. `used_bytes` never exceeds `capacity_bytes`; `high_water_bytes` is the most it
    reached. On CUDA a slot given back with `readers` (events after copies out of it queued on
    other streams) is reused only once they completed. Thread-safe."""

    def __init__(self, device: torch.device, capacity_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        check_staging_bytes("staging_bytes", capacity_bytes)
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._cond = threading.Condition()
        self._arena: torch.Tensor | None = None  # uint8 [capacity], at the first take
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, size), by offset
        self._slots: dict[int, int] = {}  # offset -> size of each slot handed out
        self._pending: list[tuple[int, int, list[Any]]] = []  # given back, readers still run
        self.used_bytes = 0
        self.high_water_bytes = 0
        self.num_waits = 0  # takes that found no room at first

    @property
    def max_piece_bytes(self) -> int:
        """The largest piece a transfer should stage here (`PIECES_PER_POOL`)."""
        return self.capacity_bytes // PIECES_PER_POOL // SLOT_ALIGN * SLOT_ALIGN

    def ensure(self) -> None:
        """Allocate the arena if it is not yet; StagingError when that fails."""
        with self._cond:
            if self._arena is not None:
                return
            try:
                self._arena = self._allocate()
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                raise StagingError(
                    f"could not allocate the {self.capacity_bytes}-byte KV staging pool on "
                    f"{self.device}: {e}"
                ) from e

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)

    def try_take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor of `shape` and `dtype` (contents undefined) in a free slot, or
        None while there is no room. StagingError when the arena cannot be allocated or the
        tensor is larger than the whole pool (it would never fit)."""
        nbytes = _nbytes(shape, dtype)
        if nbytes > self.capacity_bytes:
            raise StagingError(
                f"a piece of {nbytes} bytes is larger than the KV staging pool "
                f"({self.capacity_bytes} bytes)"
            )
        self.ensure()
        size = max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)
        with self._cond:
            self._reclaim()
            offset = self._carve(size)
            if offset is None:
                return None
            assert self._arena is not None
            self._slots[offset] = size
            self.used_bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self.used_bytes)
            flat = self._arena[offset : offset + nbytes]
        return flat.view(dtype).view(shape)

    def take(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        timeout_s: float,
        stop: Callable[[], bool] | None = None,
        between: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """`try_take`, waiting up to `timeout_s` for room; StagingError when none came, or
        when `stop()` turned true meanwhile. `between()` runs at each look, for a caller whose
        own work frees slots (the send thread reaping its sends, a channel thread handing
        landed pieces to the inbox); True means it made progress, which restarts the timeout."""
        deadline = time.monotonic() + timeout_s
        waited = False
        while (tensor := self.try_take(shape, dtype)) is None:
            if not waited:
                waited = True
                with self._cond:
                    self.num_waits += 1
            if between is not None and between():
                deadline = time.monotonic() + timeout_s
                continue
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop()):
                raise StagingError(
                    f"no room in the KV staging pool ({self.capacity_bytes} bytes, "
                    f"{self.used_bytes} in use) for {timeout_s:g}s"
                )
            self.wait(min(left, 0.001 if between is not None else 0.05))
        return tensor

    def wait(self, timeout_s: float) -> None:
        """Until a slot is given back, or `timeout_s` passed (a slot with CUDA readers pending
        frees without a notification: callers wait in short ticks)."""
        with self._cond:
            self._cond.wait(timeout_s if not self._pending else min(timeout_s, 0.001))

    def give(self, tensor: torch.Tensor, readers: list[Any] | None = None) -> None:
        """Return the slot of a tensor from `try_take`/`take`. `readers`: CUDA events after the
        last reads queued on other streams; the slot is reused only once they completed."""
        with self._cond:
            assert self._arena is not None
            offset = tensor.data_ptr() - self._arena.data_ptr()
            size = self._slots.pop(offset)
            self.used_bytes -= size
            if readers:
                self._pending.append((offset, size, readers))
            else:
                self._free_region(offset, size)
            self._cond.notify_all()

    def give_after_reads(self, tensor: torch.Tensor) -> None:
        """`give`, from a thread whose current stream may still have copies out of `tensor`
        queued (the inbox's scatter): on CUDA an event recorded now guards the slot."""
        readers = None
        if tensor.is_cuda:
            event = torch.cuda.Event()
            event.record()
            readers = [event]
        self.give(tensor, readers)

    def _carve(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def _free_region(self, offset: int, size: int) -> None:
        """Back into the free list, merged with its neighbours."""
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and offset + size == free[i + 1][0]:
            free[i] = (offset, size + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def _reclaim(self) -> None:
        """Slots whose CUDA readers completed become free (called under the lock)."""
        if not self._pending:
            return
        still = []
        for offset, size, readers in self._pending:
            if all(event.query() for event in readers):
                self._free_region(offset, size)
            else:
                still.append((offset, size, readers))
        self._pending = still


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


NCCL_COMM_BYTES = 256 << 20
"""Device memory budgeted per NCCL communicator (one per torch_dist channel: a prefill rank
has one per decode worker it sends to, a decode worker one per prefill rank): NCCL's
per-peer buffers (`NCCL_BUFFSIZE`, 4 MiB by default, per channel and direction) and its
internal state. An estimate: NCCL does not report it."""


def transfer_reservations(
    kv_backend: str, staging_bytes: int, num_nccl_peers: int
) -> dict[str, int]:
    """GPU memory (name -> bytes) a worker's KV pool sized from free memory leaves for KV
    transfer with caches on CUDA: the staging pool (`staging_bytes`, whatever the transfers'
    lengths) and `num_nccl_peers` NCCL communicators (torch_dist, the backend for CUDA caches;
    "local" and "nixl" move blocks cache to cache, without either)."""
    if kv_backend in ("local", "nixl"):
        return {}
    return {"kv_staging": staging_bytes, "nccl": num_nccl_peers * NCCL_COMM_BYTES}
