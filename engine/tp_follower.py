"""`python -m duet.engine.tp_follower`: one follower rank (1..N-1) of a tensor-parallel engine
that `TPGroup.start` (engine/tp_group.py) launched: join the group, build the engine, apply
rank 0's broadcast commands until it stops. Exits 0 after rank 0's `Stop`, 1 on a failure
(rank 0 gone, a collective broken)."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import signal
from collections.abc import Sequence

import torch.distributed as dist

from duet.engine.config import EngineConfig
from duet.engine.core import EngineCore, EngineDeadError
from duet.engine.data_parallel import follow
from duet.engine.llm_engine import LLMEngine
from duet.engine.tp_group import (
    GROUP_TIMEOUT_S,
    exit_rank,
    init_data_parallel,
    init_tensor_parallel,
)


def main(argv: Sequence[str] | None = None) -> int:
    """A follower rank: join the group, build the engine, follow rank 0 until it stops."""
    parser = argparse.ArgumentParser(prog="python -m duet.engine.tp_follower")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    # NOTE: Ctrl-C reaches the terminal's whole process group; a follower stops when rank 0
    # broadcasts Stop (or its collectives break when rank 0 dies), never on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    store = dist.TCPStore(
        "127.0.0.1", args.store_port, config.num_ranks, is_master=False,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    if config.data_parallel_size > 1:  # its own requests, in step with rank 0
        dp_rank, dp_control = init_data_parallel(
            args.rank, config.num_ranks, config.resolve_device(args.rank), store, GROUP_TIMEOUT_S
        )
        follow(LLMEngine(config, dp_rank), args.rank, dp_control, dp_rank.shared_segment)
        dist.destroy_process_group()
        return 0
    tp, control = init_tensor_parallel(
        args.rank, config.tensor_parallel_size, config.resolve_device(args.rank), store=store,
        num_stages=config.pipeline_parallel_size,
    )  # fmt: skip
    core = EngineCore(
        lambda: LLMEngine(config, tp), tp=tp, control_group=control, name=f"engine-tp{args.rank}"
    )
    core.wait_ready()
    core.join()
    stopped = isinstance(core.dead, EngineDeadError)  # by rank 0's Stop, not a failure
    dist.destroy_process_group()
    return 0 if stopped else 1


if __name__ == "__main__":
    exit_rank(main())
