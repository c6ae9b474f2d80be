"""Data-parallel attention for a mixture of experts (`data_parallel_size` D > 1): D engine ranks,
each with its own requests, scheduler and KV cache, running attention and the dense layers on
its own tokens, whose sparse layers exchange (token, choice) rows by all-to-all so that each
rank holds only 1/D of the routed experts (engine/model/moe_exchange.py). It is expert
parallelism beyond the tensor-parallel size, as vLLM's and SGLang's DP attention.

Rank 0 is the offline `LLM` on the caller's thread (`DPLeader`), or a served engine's
`EngineCore` with a `DataParallelRole`; ranks 1..D-1 are child processes (`TPGroup.start`, the
launcher of tensor parallelism; `python -m duet.engine.tp_follower`, running `follow`). In
lockstep, once per iteration:

1. rank 0 broadcasts its commands: each new request with the rank it goes to (`DPLeader.assign`:
   the fewest unfinished requests, the lowest rank on a tie), aborts, and `Stop` at the end;
2. every rank applies its own and steps its engine once; a rank with nothing scheduled serves
   its experts instead (every sparse layer with no tokens of its own: `ModelRunner.
   serve_experts`), so every rank takes part in every layer's exchange of the step;
3. every rank's raw outputs (token ids) and unfinished count go to rank 0 in one gather;
   rank 0 makes their text (the `LLM`, or each stream's reader) and, when a stop string ends
   a sample, sends the owning rank a `FinishStopped` with the next iteration's commands.

Every collective runs under the group's timeout (`GROUP_TIMEOUT_S`); a rank that dies breaks
the others' next collective, which raises instead of hanging. The disaggregated workers do
not run data-parallel yet (their engines refuse `data_parallel_size` > 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from duet.engine.commands import AbortRequest, AddRequest, FinishStopped, ResetPrefixCache, Stop
from duet.engine.engine_role import EngineDeadError, EngineRole
from duet.engine.errors import InvalidInputError
from duet.engine.outputs import EngineOutput
from duet.engine.shm_collectives import LocalCollectives
from duet.engine.stats import EngineStats
from duet.engine.tp_group import CommandLeader

STATS_EVERY_S = 0.5
"""How often a follower sends its counters with its report (they are a few lists of ints)."""


@dataclass(frozen=True)
class AddOnRank:
    """`add` for the data-parallel rank `rank` only."""

    rank: int
    add: AddRequest


DPCommand = AddOnRank | AbortRequest | FinishStopped | ResetPrefixCache | Stop


@dataclass(frozen=True)
class RankReport:
    """What a rank sends rank 0 after each step."""

    outputs: list[EngineOutput]
    """Raw (token ids): rank 0 assembles them, or its streams' readers do, and sends a
    `FinishStopped` back when a stop string ends a sample."""
    unfinished: int
    errors: list[tuple[str, str, str]]
    """(request id, field, message) of requests this rank refused to add."""
    stats: EngineStats | None = None
    """The rank's counters, at most every `STATS_EVERY_S` (a served engine's `/metrics`)."""


class DPLeader(CommandLeader):
    """Rank 0's side of the lockstep: assigns requests to ranks, sends each iteration's
    commands (`sync`) and collects every rank's outputs (`gather`)."""

    group_name = "data-parallel"

    def __init__(
        self, size: int, control: dist.ProcessGroup, local: LocalCollectives | None = None
    ) -> None:
        super().__init__()
        self.size = size
        self.control = control
        self.local = local  # the ranks' shared-memory segment, when they share a machine
        self.unfinished = [0] * size  # per rank, as of the last gather plus assignments since
        self.iterations = 0  # lockstep iterations so far

    def assign(self) -> int:
        """The rank for a new request: the fewest unfinished, the lowest rank on a tie."""
        rank = min(range(self.size), key=lambda r: (self.unfinished[r], r))
        self.unfinished[rank] += 1
        return rank

    def _send(self, commands: list[DPCommand]) -> None:
        self.iterations += 1
        _broadcast(commands, self.control, self.local)

    def gather(self, own: RankReport) -> list[RankReport]:
        """Every rank's report of this step (rank 0's is `own`), in rank order."""
        reports = _gather(own, self.control, self.local, self.size)
        assert reports is not None
        self.unfinished = [report.unfinished for report in reports]
        return reports

    @property
    def total_unfinished(self) -> int:
        return sum(self.unfinished)


def _broadcast(
    commands: list[DPCommand] | None, control: dist.ProcessGroup, local: LocalCollectives | None
) -> list[DPCommand]:
    """Rank 0's `commands` on every rank (the others pass None): through the shared segment
    when there is one (a pickled object over gloo took about 0.6 ms on a 2-core VM)."""
    if local is not None:
        return list(local.broadcast_object(commands))
    box: list[Any] = [commands]
    dist.broadcast_object_list(box, group=control, group_src=0)
    return list(box[0])


def _gather(
    report: RankReport, control: dist.ProcessGroup, local: LocalCollectives | None, size: int
) -> list[RankReport] | None:
    """Every rank's report on rank 0, in rank order (None on the others). `size`: the group's
    on rank 0, 0 on the others."""
    if local is not None:
        return local.gather_object(report)
    reports: list[Any] | None = [None] * size if size else None
    dist.gather_object(report, reports, group=control, group_dst=0)
    return reports


def follow(
    engine: Any, rank: int, control: dist.ProcessGroup, local: LocalCollectives | None = None
) -> None:
    """A follower rank's loop (`engine`: its `LLMEngine`): apply rank 0's commands that are its
    own, step, report its raw outputs; until `Stop`. `local`: the ranks' shared segment, when
    they share a machine (rank 0's `DPLeader` must have it too)."""
    engine.assemble_outputs = False  # rank 0 assembles
    stats_sent = 0.0
    while True:
        commands = _broadcast(None, control, local)
        report = RankReport([], 0, [])
        if not _apply(engine, rank, commands, report):
            return
        report.outputs.extend(engine.step_outputs())
        stats = None
        if time.monotonic() - stats_sent >= STATS_EVERY_S:
            stats, stats_sent = engine.stats, time.monotonic()
        report = RankReport(report.outputs, engine.num_unfinished_requests, report.errors, stats)
        _gather(report, control, local, 0)


def _apply(engine: Any, rank: int, commands: Sequence[DPCommand], report: RankReport) -> bool:
    for cmd in commands:
        if isinstance(cmd, Stop):
            return False
        if isinstance(cmd, AbortRequest):
            aborted = engine.abort(cmd.request_id)  # None where it is not running
            if aborted is not None:
                report.outputs.append(aborted)
        elif isinstance(cmd, FinishStopped):
            if cmd.request_id in engine.requests:
                engine.finish_stopped(cmd.request_id, cmd.index, cmd.num_tokens)
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
                report.errors.append((add.request_id, e.field, e.message))
    return True


class DataParallelRole(EngineRole):
    """Rank 0's role in a served engine (`AsyncEngine.from_config`): the lockstep of the module
    docstring around rank 0's `EngineCore` loop. A new request goes to the rank with the fewest
    unfinished ones; rank 0's own run here, the others' are broadcast before the step
    (`before_step`), and after it every rank's raw outputs reach their streams on this
    process (`after_step`), whose readers assemble them; aborts and stop strings of another
    rank's requests go to it the same way."""

    def __init__(self, leader: DPLeader, end_followers: Callable[[], None]) -> None:
        """`end_followers`: stop the follower processes at once (the loop failed, so they
        wait in a collective that will not come)."""
        super().__init__()
        self.leader = leader
        self.end_followers = end_followers
        self.remote: set[str] = set()  # request ids running on other ranks
        self.rank_stats: dict[int, EngineStats] = {}  # each follower's last counters

    def add(self, cmd: AddRequest) -> None:
        rank = self.leader.assign()
        if rank == 0:
            try:
                super().add(cmd)
            except Exception:
                self.leader.unfinished[0] -= 1
                raise
            return
        self.leader.record(AddOnRank(rank, cmd))
        self.remote.add(cmd.request_id)

    def abort(self, cmd: AbortRequest) -> None:
        if cmd.request_id in self.remote:
            self.leader.record(cmd)  # its final output comes back in the rank's report
        else:
            super().abort(cmd)

    def finish_stopped(self, cmd: FinishStopped) -> None:
        if cmd.request_id in self.remote:
            self.leader.record(cmd)
        else:
            super().finish_stopped(cmd)

    def before_step(self) -> None:
        self.leader.sync()

    def after_step(self, outputs: list[EngineOutput]) -> None:
        super().after_step(outputs)
        own = RankReport([], self.engine.num_unfinished_requests, [])
        for rank, report in enumerate(self.leader.gather(own)):
            if rank == 0:
                continue
            if report.stats is not None:
                self.rank_stats[rank] = report.stats
            for out in report.outputs:
                self.core.publish(out.request_id, out)
                if out.finished:
                    self.remote.discard(out.request_id)
            for request_id, field, message in report.errors:
                self.core.publish(request_id, InvalidInputError(field, message))
                self.remote.discard(request_id)

    def stats(self) -> EngineStats:
        """Every rank's counters as one engine's (the followers' as of their last report)."""
        others = [self.rank_stats[r] for r in sorted(self.rank_stats)]
        return EngineStats.summed([self.engine.stats, *others])

    def busy_elsewhere(self) -> bool:
        return self.leader.total_unfinished > self.engine.num_unfinished_requests

    def on_exit(self) -> None:
        if isinstance(self.core.dead, EngineDeadError):  # shut down: the followers in step
            self.leader.stop()
        else:  # a failure: the followers may be inside any collective
            self.leader.broken()
            self.end_followers()
