"""Starting a decode worker rank in a process: the tensor-parallel group and the engine (rank 0
serves gRPC), or a data-parallel group's worker (each serves gRPC). Used by
`python -m duet.decode_worker` and by the Ray actors."""

from __future__ import annotations

from typing import Any

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from duet.engine.peer_lockstep import join_peers
from duet.engine.tp_group import init_tensor_parallel


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
    device = config.resolve_device(rank)
    tp, peers = join_peers(rank, config.data_parallel_size, device, init_method)
    return DecodeWorker(config, name, receiver_options, tp, peers=peers)
