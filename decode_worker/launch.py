"""Starting a decode worker rank in a process: the tensor-parallel group and the engine (rank 0
serves gRPC), or a data-parallel group's worker (each serves gRPC). Used by
`python -m duet.decode_worker` and by the Ray actors."""

from __future__ import annotations

import datetime
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from duet.engine.peer_lockstep import PeerLockstep
from duet.engine.tp_group import GROUP_TIMEOUT_S, init_data_parallel, init_tensor_parallel


def start_decode_rank(
    config: DecodeWorkerConfig,
    rank: int,
    init_method: str | None,
    name: str = "decode",
    receiver_options: dict[str, Any] | None = None,
) -> DecodeWorker:
    """Build this rank's worker (every rank of a group must call this, in any order). With
    `config.data_parallel_size` D > 1, `rank` is the worker's place among the D workers of
    its data-parallel group, which meet at `init_method` (tcp://HOST:PORT, rank 0 hosting)."""
    if config.data_parallel_size > 1:
        return _data_parallel_worker(config, rank, init_method, name, receiver_options)
    if config.tensor_parallel_size > 1 and init_method is None:
        raise ValueError("tp_init_method: required when tensor_parallel_size > 1")
    tp, control = init_tensor_parallel(
        rank, config.tensor_parallel_size, config.resolve_device(rank), init_method=init_method
    )
    return DecodeWorker(config, name, receiver_options, tp, control)


def _data_parallel_worker(
    config: DecodeWorkerConfig,
    rank: int,
    init_method: str | None,
    name: str,
    receiver_options: dict[str, Any] | None,
) -> DecodeWorker:
    size = config.data_parallel_size
    where = urlparse(init_method or "")
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(
            f"dp_init_method: tcp://HOST:PORT required when data_parallel_size > 1; "
            f"got {init_method!r}"
        )
    if not 0 <= rank < size:
        raise ValueError(f"dp_rank: must be in [0, {size}); got {rank}")
    store = dist.TCPStore(
        where.hostname, where.port, size, is_master=rank == 0,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    tp, control = init_data_parallel(
        rank, size, config.resolve_device(rank), store, GROUP_TIMEOUT_S
    )
    peers = PeerLockstep(rank, size, control, tp.shared_segment)
    return DecodeWorker(config, name, receiver_options, tp, peers=peers)
