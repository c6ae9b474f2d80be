"""Starting a prefill worker rank in a process: the tensor-parallel group, the engine, and (on
rank 0) the gRPC service. Used by `python -m duet.prefill_worker` and by the Ray actors."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from duet.engine.device import bind_thread
from duet.engine.parallel import SINGLE, TensorParallel
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.worker import PrefillWorker


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float = 600.0
) -> tuple[TensorParallel, dist.ProcessGroup | None]:
    """Join this group's ranks (its own world: one prefill group per process group).
    Returns the TP group (NCCL on CUDA, gloo on CPU) and a gloo group for the command
    broadcast (the TP group itself on CPU)."""
    if world_size == 1:
        return SINGLE, None
    if init_method.startswith(("tcp://127.", "tcp://localhost")):
        # gloo would otherwise bind the interface of the host's name, which may not route.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    bind_thread(device)  # NCCL's set-up runs on this thread; the engine thread binds its own
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    group = dist.group.WORLD
    control = dist.new_group(backend="gloo") if backend == "nccl" else group
    return TensorParallel(rank, world_size, group), control


def start_prefill_rank(
    config: PrefillWorkerConfig, rank: int, init_method: str | None, name: str = "prefill"
) -> PrefillWorker:
    """Build this rank's worker (every rank of a group must call this, in any order)."""
    if config.tensor_parallel_size > 1 and init_method is None:
        raise ValueError("tp_init_method: required when tensor_parallel_size > 1")
    tp, control = init_tensor_parallel(
        rank, config.tensor_parallel_size, init_method or "", config.resolve_device(rank)
    )
    return PrefillWorker(config, tp, name=name, control_group=control)
