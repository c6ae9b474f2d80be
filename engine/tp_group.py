"""A tensor-parallel engine on one machine: rank 0 in the calling process, ranks 1..N-1 as
child processes (`python -m duet.engine.tp_follower`) that follow it.

Every rank runs the same `LLMEngine` and schedules from the same inputs: rank 0 broadcasts the
commands of each iteration (an `EngineCore` with a group does this; `TPLeader` does it for
the offline `LLM`, which steps on the caller's thread), samples, and broadcasts the step's
tokens (docs/parallelism.md). A follower is an `EngineCore` with the default role that takes
no commands of its own; it ends when rank 0 broadcasts `Stop`, and fails (its collectives
break) when rank 0's process dies.

The rendezvous is a `TCPStore` that rank 0 serves on a free loopback port, and only there
(`rendezvous.listening_store`), and hands to its children on their command line; NCCL on CUDA
(one device per rank) with a gloo group beside it for the command broadcast, gloo on CPU.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, NoReturn
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from duet.engine.commands import EngineCommand, Stop
from duet.engine.config import EngineConfig
from duet.engine.device import bind_thread
from duet.engine.errors import InvalidInputError
from duet.engine.parallel import SINGLE, ExpertExchange, TensorParallel, check_tp_size
from duet.engine.pipeline import PipelineParallel, check_pp_size
from duet.engine.rendezvous import gloo_interface_toward, listening_store
from duet.engine.shm_collectives import LocalCollectives

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0
"""Longest a collective (and the rendezvous) waits: a slow rank's model load or prefill step
is within it; a dead rank's peers fail at once on the broken connection instead."""
STOP_TIMEOUT_S = 30.0
"""How long `close` waits for the followers to exit after `Stop` before killing them."""


def init_tensor_parallel(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    init_method: str | None = None,
    store: dist.Store | None = None,
    timeout_s: float = GROUP_TIMEOUT_S,
    num_stages: int = 1,
) -> tuple[TensorParallel, dist.ProcessGroup | None]:
    """Join this group's ranks (its own world: one engine per process group) through
    `init_method` (a tcp:// URL) or `store`. `rank`: the global rank (stage x TP + TP rank);
    `world_size`: the TP size; `num_stages`: pipeline stages (engine/pipeline.py). Returns the
    layout (the stage's TP group: NCCL on CUDA, gloo on CPU; the pipeline over the world) and
    a gloo group over every rank for the command broadcast (the world itself on CPU)."""
    if world_size * num_stages == 1:
        return SINGLE, None
    meet = urlparse(init_method or "")
    if meet.scheme == "tcp" and meet.hostname:
        # gloo would otherwise bind the interface of the host's name, which may not route.
        gloo_interface_toward(meet.hostname)
    if store is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a loopback store: one machine
    backend = "nccl" if device.type == "cuda" else "gloo"
    bind_thread(device)  # NCCL's set-up runs on this thread; the engine thread binds its own
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size * num_stages,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    world = dist.group.WORLD
    control = dist.new_group(backend="gloo") if backend == "nccl" else world
    if num_stages == 1:
        local = _local_collectives(world, rank, world_size, timeout_s, backend)
        return TensorParallel(rank, world_size, world, local=local), control
    stage, tp_rank = divmod(rank, world_size)
    group: dist.ProcessGroup | None = world
    for s in range(num_stages):  # every rank creates every stage's group, in order
        ranks = list(range(s * world_size, (s + 1) * world_size))
        made = dist.new_group(ranks) if world_size > 1 else None
        if s == stage:
            group = made
    pp = PipelineParallel(stage, num_stages, tp_rank, world_size, world)  # group: None at TP 1
    local = _local_collectives(group, tp_rank, world_size, timeout_s, backend)
    return TensorParallel(tp_rank, world_size, group, pp, local=local), control


def init_data_parallel(
    rank: int, size: int, device: torch.device, store: dist.Store, timeout_s: float
) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Join the D ranks' group (gloo on the CPU, its all-to-alls through shared memory when the
    ranks share a machine; NCCL on CUDA with a gloo group beside it for the commands and
    reports). Returns this rank's layout (TP 1, the expert exchange over the
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
    local = _local_collectives(world, rank, size, timeout_s, backend)
    return TensorParallel(exchange=ExpertExchange(rank, size, world, local)), control


def _local_collectives(
    group: dist.ProcessGroup | None, rank: int, world_size: int, timeout_s: float, backend: str
) -> LocalCollectives | None:
    """The group's shared-memory collectives, when its ranks are CPU processes on one machine
    (collective: every rank of the group calls it)."""
    if backend != "gloo" or world_size == 1 or group is None:
        return None
    return LocalCollectives.create(group, rank, world_size, timeout_s)


def rank_config(config: EngineConfig) -> EngineConfig:
    """`config` as each rank runs it: on the CPU, without a thread count, the cores shared out
    between the ranks (N ranks each using every core would make them wait on each other's
    OpenMP pools at every collective)."""
    if config.num_threads or config.resolve_device().type != "cpu":
        return config
    threads = max(1, (os.cpu_count() or 1) // config.num_ranks)
    return dataclasses.replace(config, num_threads=threads)


def check_layout(config: EngineConfig) -> None:
    """Raise `InvalidInputError` naming `tensor_parallel_size` when the model cannot be split
    over that many ranks (more ranks than query heads, or than 1-column MLP shares), or
    `pipeline_parallel_size` when it has fewer layers than stages, or `expert_parallel_size`
    for a dense model or experts that do not split into whole shares."""
    from duet.engine.loader import open_model
    from duet.engine.model.mla import check_mla_layout
    from duet.engine.model.mlp import mlp_shard
    from duet.engine.model.moe import check_ep_size

    arch = open_model(config.model, config.tokenizer, config.hf_overrides, config.load_format).arch
    check_mla_layout(arch, config.tensor_parallel_size)
    check_tp_size(config.tensor_parallel_size, arch.num_attention_heads)
    for size in arch.ffn_sizes():  # the dense MLP's, the experts'
        mlp_shard(size, TensorParallel(0, config.tensor_parallel_size))
    check_pp_size(config.pipeline_parallel_size, arch.num_hidden_layers)
    if config.data_parallel_size > 1 and arch.moe is None:
        raise InvalidInputError(
            "data_parallel_size",
            f"must be 1 for a dense model: data-parallel ranks exchange a mixture's routed "
            f"experts (several replicas of a dense model are several engines); got "
            f"{config.data_parallel_size}",
        )
    check_ep_size(config.expert_parallel_size, arch.moe)


def exit_rank(code: int) -> NoReturn:
    """End a process that was a rank of a group: the atexit handlers run (logs and trace
    exporters flush), then the process exits without finalizing the interpreter.

    NOTE: not `sys.exit`. A gloo worker thread (`ProcessGroupGloo::runLoop`) destroys each
    collective's work after it signalled completion, so the last one (rank 0's `Stop`
    broadcast) may still be held when the main thread returns; its tensors came from Python
    and releasing them takes the GIL. During `Py_FinalizeEx` a thread that takes the GIL is
    ended with `pthread_exit`, whose forced unwind through the noexcept `~AsyncWork` calls
    `std::terminate`: "terminate called without an active exception", SIGABRT, in about 1 of
    10 clean stops under load (seen in a core dump of a follower). `destroy_process_group`
    does not join gloo's threads, so nothing short of skipping finalization avoids it."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class TPGroup:
    """Rank 0's handle on a tensor-parallel engine's ranks on this machine: `start` launches
    the followers and joins the group; `close` stops them. Not thread-safe (the thread that
    builds the engine owns it)."""

    def __init__(
        self,
        tp: TensorParallel,
        control_group: dist.ProcessGroup | None,
        followers: list[subprocess.Popen[bytes]],
    ) -> None:
        self.tp = tp
        self.control_group = control_group
        self.followers = followers

    @classmethod
    def start(cls, config: EngineConfig, timeout_s: float = GROUP_TIMEOUT_S) -> TPGroup:
        """Launch ranks 1..N-1 of `config` (already `rank_config`'d) as child processes and
        join the group as rank 0 on this thread. Raises `RuntimeError` when a follower exits
        before the group is complete."""
        world = config.num_ranks
        if world == 1:
            return cls(SINGLE, None, [])
        check_layout(config)  # before any process starts
        store = listening_store("127.0.0.1", 0, world, timeout_s)  # loopback only
        fields = json.dumps(dataclasses.asdict(config))
        command = [sys.executable, "-m", "duet.engine.tp_follower", "--config", fields]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        followers = [
            subprocess.Popen(
                [*command, "--rank", str(rank), "--store-port", str(store.port)], env=env
            )
            for rank in range(1, world)
        ]
        control: dist.ProcessGroup | None
        try:
            if config.data_parallel_size > 1:  # (engine/data_parallel.py)
                tp, control = init_data_parallel(
                    0, world, config.resolve_device(0), store, timeout_s
                )
            else:
                tp, control = init_tensor_parallel(
                    0, config.tensor_parallel_size, config.resolve_device(0), store=store,
                    timeout_s=timeout_s, num_stages=config.pipeline_parallel_size,
                )  # fmt: skip
        except BaseException:
            _end(followers, 0.0)
            raise
        return cls(tp, control, followers)

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """After rank 0's engine broadcast `Stop` (or died): wait for the followers, killing
        any still running after `timeout_s`, and leave the group."""
        _end(self.followers, timeout_s)
        if (self.tp.spans_ranks or self.tp.exchange is not None) and dist.is_initialized():
            dist.destroy_process_group()


def _end(followers: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for proc in followers:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("tensor-parallel rank (pid %d) did not stop; killing it", proc.pid)
            proc.kill()
            proc.wait(timeout=10)


class CommandLeader:
    """Rank 0's broadcast of each iteration's commands to the follower ranks: `record` what rank
    0 applied, `sync` before each step, `stop` once (a last `Stop`). Subclasses send (`_send`):
    `TPLeader` and the data-parallel `DPLeader` (engine/data_parallel.py)."""

    group_name = "tensor-parallel"

    def __init__(self) -> None:
        self._pending: list[Any] = []
        self._stopped = False

    def record(self, cmd: Any) -> None:
        """`cmd` was applied on rank 0 (or is for another rank); the followers get it before
        their next step."""
        self._pending.append(cmd)

    def sync(self) -> None:
        """One iteration's broadcast (call before each step)."""
        if self._stopped and self._pending[-1:] != [Stop()]:
            raise RuntimeError(f"the {self.group_name} group was shut down")
        commands, self._pending = self._pending, []
        self._send(commands)

    def _send(self, commands: list[Any]) -> None:
        raise NotImplementedError

    def broken(self) -> None:
        """The followers are out of step (a collective failed, or rank 0's step did): no
        further broadcast, not even `Stop`; `sync` raises from now on."""
        self._stopped = True

    def stop(self) -> None:
        """End the followers' loops. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._pending.append(Stop())
        try:
            self.sync()
        except RuntimeError as e:  # a follower is gone: the others fail on their own
            logger.warning("%s group: could not send Stop (%s)", self.group_name, e)


class TPLeader(CommandLeader):
    """Rank 0's command broadcast for an engine stepped on the caller's thread (the offline
    `LLM`): every iteration, `sync` sends what rank 0 applied since the last one, so the
    followers' `EngineCore` loops apply the same commands before the same step."""

    def __init__(self, group: TPGroup) -> None:
        super().__init__()
        self.group = group

    def _send(self, commands: list[EngineCommand]) -> None:
        self.group.tp.broadcast_commands(commands, self.group.control_group)

    def stop(self) -> None:
        """End the followers' loops and the group. Idempotent."""
        try:
            super().stop()
        finally:
            self.group.close()
