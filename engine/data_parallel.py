"""Data-parallel attention for a mixture of experts (`data_parallel_size` D > 1): D engine ranks,
each with its own requests, scheduler and KV cache, running attention and the dense layers on
its own tokens, whose sparse layers exchange (token, choice) rows by all-to-all so that each
rank holds only 1/D of the routed experts (engine/model/moe_exchange.py). It is expert
parallelism beyond the tensor-parallel size, as vLLM's and SGLang's DP attention.

The offline `LLM` runs rank 0 on the caller's thread and ranks 1..D-1 as child processes
(`TPGroup.start`, the launcher of tensor parallelism; `python -m duet.engine.tp_follower`). In
lockstep, once per iteration:

1. rank 0 broadcasts its commands: each new request with the rank it goes to (`DPLeader.assign`:
   the fewest unfinished requests, the lowest rank on a tie), aborts, and `Stop` at the end;
2. every rank applies its own and steps its engine once; a rank with nothing scheduled serves
   its experts instead (every sparse layer with no tokens of its own: `ModelRunner.
   serve_experts`), so every rank takes part in every layer's exchange of the step;
3. every rank's outputs (assembled: text, stop strings applied on the rank that runs the
   request) and unfinished count go to rank 0 in one gather.

Every collective runs under the group's timeout (`GROUP_TIMEOUT_S`); a rank that dies breaks
the others' next collective, which raises instead of hanging. `duet serve` and the disaggregated
workers do not run data-parallel yet (each refuses `data_parallel_size` > 1).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from duet.engine.commands import AbortRequest, AddRequest, ResetPrefixCache, Stop
from duet.engine.device import bind_thread
from duet.engine.errors import InvalidInputError
from duet.engine.outputs import RequestOutput
from duet.engine.parallel import ExpertExchange, TensorParallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddOnRank:
    """`add` for the data-parallel rank `rank` only."""

    rank: int
    add: AddRequest


DPCommand = AddOnRank | AbortRequest | ResetPrefixCache | Stop


@dataclass(frozen=True)
class RankReport:
    """What a rank sends rank 0 after each step."""

    outputs: list[RequestOutput]
    unfinished: int
    errors: list[tuple[str, str, str]]
    """(request id, field, message) of requests this rank refused to add."""


def init_data_parallel(
    rank: int, size: int, device: torch.device, store: dist.Store, timeout_s: float
) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Join the D ranks' group (gloo on the CPU, NCCL on CUDA with a gloo group beside it for
    the commands and reports). Returns this rank's layout (TP 1, the expert exchange over the
    group) and the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    bind_thread(device)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    world = dist.group.WORLD
    assert world is not None
    control = dist.new_group(backend="gloo") if backend == "nccl" else world
    return TensorParallel(exchange=ExpertExchange(rank, size, world)), control


class DPLeader:
    """Rank 0's side of the lockstep for the offline `LLM`: assigns requests to ranks, sends
    each iteration's commands (`sync`) and collects every rank's outputs (`gather`)."""

    def __init__(self, size: int, control: dist.ProcessGroup) -> None:
        self.size = size
        self.control = control
        self.unfinished = [0] * size  # per rank, as of the last gather plus assignments since
        self._pending: list[DPCommand] = []
        self._stopped = False

    def assign(self) -> int:
        """The rank for a new request: the fewest unfinished, the lowest rank on a tie."""
        rank = min(range(self.size), key=lambda r: (self.unfinished[r], r))
        self.unfinished[rank] += 1
        return rank

    def record(self, cmd: DPCommand) -> None:
        """A command for the next iteration's broadcast (rank 0 applied its own already)."""
        self._pending.append(cmd)

    def sync(self) -> None:
        """This iteration's broadcast (before each step)."""
        if self._stopped and self._pending[-1:] != [Stop()]:
            raise RuntimeError("the data-parallel group was shut down")
        commands, self._pending = self._pending, []
        box: list[Any] = [commands]
        dist.broadcast_object_list(box, group=self.control, group_src=0)

    def gather(self, own: RankReport) -> list[RankReport]:
        """Every rank's report of this step (rank 0's is `own`), in rank order."""
        reports: list[Any] = [None] * self.size
        dist.gather_object(own, reports, group=self.control, group_dst=0)
        self.unfinished = [report.unfinished for report in reports]
        return reports

    @property
    def total_unfinished(self) -> int:
        return sum(self.unfinished)

    def stop(self) -> None:
        """End the followers' loops. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._pending.append(Stop())
        try:
            self.sync()
        except RuntimeError as e:  # a follower is gone: the others fail on their own
            logger.warning("data-parallel group: could not send Stop (%s)", e)


def follow(engine: Any, rank: int, control: dist.ProcessGroup) -> None:
    """A follower rank's loop (`engine`: its `LLMEngine`): apply rank 0's commands that are its
    own, step, report; until `Stop`."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=control, group_src=0)
        errors: list[tuple[str, str, str]] = []
        if not _apply(engine, rank, box[0], errors):
            return
        outputs = engine.step()
        report = RankReport(outputs, engine.num_unfinished_requests, errors)
        dist.gather_object(report, None, group=control, group_dst=0)


def _apply(
    engine: Any, rank: int, commands: Sequence[DPCommand], errors: list[tuple[str, str, str]]
) -> bool:
    for cmd in commands:
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, AbortRequest):
            if cmd.request_id in engine.requests:
                engine.abort_request(cmd.request_id)
        elif isinstance(cmd, ResetPrefixCache):
            engine.kv.pool.reset_prefix_cache()
        elif cmd.rank == rank:
            add = cmd.add
            try:
                engine.add_request(
                    add.prompt, add.params, request_id=add.request_id, priority=add.priority,
                    prompt_text=add.prompt_text,
                )  # fmt: skip
            except InvalidInputError as e:  # the caller's: rank 0 raises it
                errors.append((add.request_id, e.field, e.message))
    return True
