"""The collectives of CPU tensor-parallel ranks on one machine, through shared memory
(engine/kernels/shm_collectives_cpu.cpp) instead of gloo's loopback TCP, as vLLM's CPU backend
does: the row-parallel layers' all-reduce (two a layer), the logits' gather to rank 0, and rank
0's broadcasts of the sampled tokens and of each iteration's commands. On a 2-core VM a decode
step's all-reduce took 0.7-1.8 ms over gloo (docs/parallelism.md).

`LocalCollectives.create` is collective over the group: every rank says where it runs; when
all run on one machine, rank 0 makes a segment in /dev/shm, every rank maps it and says whether
it could, and rank 0 unlinks the file once all have (the mappings stay, and nothing is left
behind when a rank dies). Any rank unable to: all of them keep gloo. `DUET_SHM_COLLECTIVES=0`
keeps gloo too. Sums are in rank order on every rank (docs/determinism.md)."""

from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from duet.engine.kernels.cpu import build_cpu_kernels, cpu_kernels_enabled

logger = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20
"""Each rank's share of one call: a tensor larger than this goes through in chunks of it."""
LINE = 64
SHM_DIR = Path("/dev/shm")
SUMMABLE = (torch.float32, torch.bfloat16, torch.float16)


def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Sequence numbers and pids (a cache line each per rank), then two buffers of slots."""
    return 2 * world * LINE + 2 * world * slot_bytes


class LocalCollectives:
    """One rank's end of a group's shared segment. Every rank must make the same calls in the
    same order, as with any collective; a call that returns False (or None) did nothing, for
    a tensor it does not take, and the caller then uses gloo: every rank sees the same shapes
    and types, so all decide alike."""

    def __init__(
        self, kernels: Any, segment: torch.Tensor, rank: int, world: int, timeout_s: float
    ) -> None:
        self._kernels = kernels
        self._segment = segment
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._calls = 0
        pids = segment[world * LINE : 2 * world * LINE].view(torch.int64)
        pids[rank * (LINE // 8)] = os.getpid()  # read by the others while they wait

    def _args(self) -> tuple[Any, ...]:
        return self._segment, self.rank, self.world, SLOT_BYTES, self._calls, self.timeout_s

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks, in place."""
        if x.dtype not in SUMMABLE or x.device.type != "cpu" or not x.is_contiguous():
            return False
        self._calls = self._kernels.shm_all_reduce(x, *self._args())
        return True

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` (one shape and type on all), stacked in rank order:
        [world, *x.shape]."""
        if x.device.type != "cpu" or not x.is_contiguous():
            return None
        out = torch.empty((self.world, *x.shape), dtype=x.dtype)
        self._calls = self._kernels.shm_all_gather(x, out, *self._args())
        return out

    def broadcast(self, x: torch.Tensor) -> bool:
        """Rank 0's `x` into every rank's, in place."""
        if x.device.type != "cpu" or not x.is_contiguous():
            return False
        self._calls = self._kernels.shm_broadcast(x, *self._args())
        return True

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable; the others pass anything) on every rank: its length,
        then its bytes."""
        if self.rank == 0:
            data = bytearray(pickle.dumps(obj))  # writable: the tensor below is a view of it
            self.broadcast(torch.tensor([len(data)], dtype=torch.int64))
            self.broadcast(torch.frombuffer(data, dtype=torch.uint8))
            return obj
        length = torch.empty(1, dtype=torch.int64)
        self.broadcast(length)
        buffer = torch.empty(int(length), dtype=torch.uint8)
        self.broadcast(buffer)
        return pickle.loads(buffer.numpy().data)

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (picklable), in rank order, on rank 0; None on the others: the
        lengths, then the bytes padded to the longest, both all-gathered (only rank 0
        unpickles)."""
        data = bytearray(pickle.dumps(obj))
        lengths = self.all_gather(torch.tensor([len(data)], dtype=torch.int64))
        assert lengths is not None
        padded = torch.zeros(int(lengths.max()), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(data, dtype=torch.uint8)
        every = self.all_gather(padded)
        assert every is not None
        if self.rank != 0:
            return None
        return [
            pickle.loads(every[r, : int(lengths[r])].numpy().tobytes()) for r in range(self.world)
        ]

    @classmethod
    def create(
        cls, group: dist.ProcessGroup, rank: int, world: int, timeout_s: float
    ) -> LocalCollectives | None:
        """Collective: every rank of `group` (`rank` of `world` in it) calls it; all get a
        `LocalCollectives`, or all None."""
        kernels = _kernels()
        where: list[Any] = [None] * world
        dist.all_gather_object(where, (kernels is not None, _machine()), group=group)
        if not all(ok and place == where[0][1] for ok, place in where):
            return None
        name = [f"duet-tp-{uuid.uuid4().hex}" if rank == 0 else None]
        path = SHM_DIR / str(name[0])
        size = segment_bytes(world)
        if rank == 0:
            try:
                with open(path, "wb") as f:
                    f.truncate(size)
            except OSError as e:
                logger.warning("no shared-memory collectives (%s): gloo it is", e)
                name = [""]
        dist.broadcast_object_list(name, group=group, group_src=0)
        segment = None
        if name[0]:
            try:
                segment = torch.from_file(
                    str(SHM_DIR / str(name[0])), shared=True, size=size, dtype=torch.uint8
                )
            except RuntimeError as e:
                logger.warning("could not map the shared-memory collectives' segment: %s", e)
        mapped: list[Any] = [None] * world
        dist.all_gather_object(mapped, segment is not None, group=group)  # all mapped it
        if rank == 0 and name[0]:
            path.unlink(missing_ok=True)
        if segment is None or not all(mapped):
            return None
        assert kernels is not None
        return cls(kernels, segment, rank, world, timeout_s)


def _kernels() -> Any | None:
    if os.environ.get("DUET_SHM_COLLECTIVES", "1") == "0" or not cpu_kernels_enabled():
        return None
    if not SHM_DIR.is_dir():
        return None
    return _build()


@functools.cache
def _build() -> Any | None:
    try:
        return build_cpu_kernels(
            module="duet_shm_collectives", sources=("shm_collectives_cpu.cpp",)
        )
    except Exception as e:  # any build failure: gloo
        logger.warning("shared-memory collectives unavailable (%s); using gloo", e)
        return None


def _machine() -> tuple[str, ...]:
    """Where this process runs: host name, boot id, and PID and network namespaces (the
    kernel checks a waited-for rank's pid, which must mean the same process to every rank;
    tests stand hosts up as network namespaces of one machine, which stay apart)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    namespaces = []
    for kind in ("pid", "net"):
        try:
            namespaces.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:
            namespaces.append("")
    return (socket.gethostname(), boot.read_text().strip() if boot.exists() else "", *namespaces)
