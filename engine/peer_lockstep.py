"""Data-parallel attention between independent engines: D engines, each with its own requests,
scheduler, KV cache and callers (D decode workers, say, each its own server), whose mixture
layers exchange the routed experts (engine/model/moe_exchange.py) and so must step together.

`engine/data_parallel.py` runs D ranks under one leader: rank 0 takes every request and
broadcasts each iteration's commands. Here no rank leads: each `EngineCore` takes its own
commands, and once per iteration, after its role's `before_step`, the peers agree by one
all-gather of two flags each (`PeerLockstep.agree`): whether it has schedulable requests, and
whether it is stopping. If any has work, every peer steps (one with none runs each sparse
layer with no tokens of its own, serving the others' rows: `ModelRunner.serve_experts`), so
each peer runs the same number of forward passes and every layer's exchange lines up; if none
has, none steps. If any stops, all stop (the group is one unit: a peer left alone would wait
in its next exchange for the one that left).

An idle peer comes back to the agreement at least every `PEER_IDLE_WAIT_S` (instead of the
core's 0.5 s idle wait), since a peer that got a request waits there for it; a peer sees that
another has work from the last agreement and steps at once. On one machine the flags go
through the group's shared-memory segment; else over gloo.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from duet.engine.collective_clock import COLLECTIVES
from duet.engine.parallel import TensorParallel
from duet.engine.rendezvous import gloo_interface_toward, listening_store
from duet.engine.shm_collectives import LocalCollectives
from duet.engine.tp_group import GROUP_TIMEOUT_S, init_data_parallel

logger = logging.getLogger(__name__)

PEER_IDLE_WAIT_S = 0.005
"""Longest wait for a command while no peer has work: a request arriving at an idle group
waits at most this long for the others to agree."""


class PeerLockstep:
    """One engine's place among its data-parallel peers (`rank` of `size` in `group`, the
    ranks of `init_data_parallel`; `local`: their shared segment, when they share a
    machine)."""

    def __init__(
        self, rank: int, size: int, group: dist.ProcessGroup, local: LocalCollectives | None
    ) -> None:
        self.rank, self.size, self.group, self.local = rank, size, group, local
        self.others_busy = False
        """Whether another peer had work at the last agreement (the core then steps again at
        once instead of waiting for a command)."""

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """Collective, once per iteration on every peer: (whether any peer has work, whether
        any stops)."""
        flags = torch.tensor([int(has_work), int(stopping)], dtype=torch.int64)
        with COLLECTIVES:
            every = self.local.all_gather(flags) if self.local is not None else None
            if every is None:
                parts = [torch.empty_like(flags) for _ in range(self.size)]
                dist.all_gather(parts, flags, group=self.group)
                every = torch.stack(parts)
        others = torch.cat([every[: self.rank], every[self.rank + 1 :]])
        self.others_busy = bool(others[:, 0].any())
        return bool(every[:, 0].any()), bool(every[:, 1].any())


def join_peers(
    rank: int, size: int, device: torch.device, init_method: str | None
) -> tuple[TensorParallel, PeerLockstep]:
    """Join a data-parallel group of `size` workers as `rank`, meeting at `init_method`
    (tcp://HOST:PORT; rank 0 hosts the store): this worker's layout (the expert exchange) and
    its place among the peers. Every worker of the group must call it."""
    where = urlparse(init_method or "")
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(
            "dp_init_method: tcp://HOST:PORT required when data_parallel_size > 1; "
            f"got {init_method!r}"
        )
    if not 0 <= rank < size:
        raise ValueError(f"dp_rank: must be in [0, {size}); got {rank}")
    interface = gloo_interface_toward(where.hostname)  # the peers may be other machines
    if rank == 0:  # the store listens on the address the peers were given, only
        store = listening_store(where.hostname, where.port, size, GROUP_TIMEOUT_S)
    else:
        store = dist.TCPStore(
            where.hostname, where.port, size, is_master=False,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )  # fmt: skip
    tp, control = init_data_parallel(rank, size, device, store, GROUP_TIMEOUT_S)
    if device.type == "cuda":
        through = "NCCL"
    elif tp.shared_segment is not None:
        through = "shared memory (one machine)"
    else:
        through = f"gloo over {interface}" if interface else "gloo (its host name's interface)"
    logger.info("data-parallel rank %d of %d: experts exchanged through %s", rank, size, through)
    return tp, PeerLockstep(rank, size, control, tp.shared_segment)


async def until_stopped(stop: asyncio.Event, is_running: Callable[[], bool]) -> None:
    """A worker process's serving wait: until `stop` is set (a signal), or until its engine
    ended: it failed (a tensor-parallel rank killed, a step that raised; the process then exits
    1, for its supervisor to restart it, instead of serving "not running" until a signal), or a
    data-parallel peer stopped the group."""
    while not stop.is_set() and is_running():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
