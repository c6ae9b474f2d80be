"""Starting a prefill worker rank in a process: the tensor-parallel group, the engine, and (on
rank 0) the gRPC service; or a data-parallel group's worker (each serves gRPC). Used by
`python -m duet.prefill_worker` and by the Ray actors."""

from __future__ import annotations

from duet.engine.peer_lockstep import join_peers
from duet.engine.tp_group import init_tensor_parallel
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.worker import PrefillWorker


def start_prefill_rank(
    config: PrefillWorkerConfig, rank: int, init_method: str | None, name: str = "prefill"
) -> PrefillWorker:
    """Build this rank's worker (every rank of a group must call this, in any order). `rank`:
    the global rank, stage x tensor_parallel_size + TP rank (engine/pipeline.py); with
    `config.data_parallel_size` D > 1, the worker's place among the D whole workers of its
    data-parallel group, which meet at `init_method` (tcp://HOST:PORT, rank 0 hosting)."""
    if config.data_parallel_size > 1:
        device = config.resolve_device(rank)
        dp, peers = join_peers(rank, config.data_parallel_size, device, init_method)
        return PrefillWorker(config, dp, name=name, peers=peers)
    if config.num_ranks > 1 and init_method is None:
        raise ValueError(
            "tp_init_method: required when tensor_parallel_size x pipeline_parallel_size > 1"
        )
    tp, control = init_tensor_parallel(
        rank, config.tensor_parallel_size, config.resolve_device(rank), init_method=init_method,
        num_stages=config.pipeline_parallel_size,
    )  # fmt: skip
    return PrefillWorker(config, tp, name=name, control_group=control)
