"""Tensor parallelism: which shard of each weight a rank holds, and the collectives that join
the shards (`torch.distributed`: gloo on CPU, NCCL on GPU).

Layout (Megatron style): q/k/v and gate/up are column-parallel (a rank holds its heads / its
slice of the intermediate size), o_proj and down_proj are row-parallel (partial sums,
all-reduced), the embedding and LM head are vocab-parallel. Each rank keeps only the KV heads of
its shard in its cache.

Heads are split by KV group (`head_shard`), so that every rank's query heads map onto its own
KV heads by one group size, which is what the attention kernels assume:
- TP <= KV heads: each rank holds whole groups, as evenly as they divide (SmolLM2's 3 KV heads
  at TP=2: one group on rank 0, two on rank 1);
- TP > KV heads: each rank holds part of one group's query heads and that group's KV head,
  which is replicated on every rank that shares the group (Llama-3-8B's 8 KV heads at TP=16).
Any TP size from 1 to the number of query heads is possible; the intermediate size and the
vocabulary split as evenly as they divide (`split`), so no size has to be a multiple of TP.
The layout is docs/parallelism.md's; `kv_head_range` is what the KV hand-off reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from duet.engine.collective_clock import COLLECTIVES
from duet.engine.errors import InvalidInputError
from duet.engine.pipeline import NO_PIPELINE, PipelineParallel

if TYPE_CHECKING:
    from duet.engine.shm_collectives import LocalCollectives


def check_tp_size(world_size: int, num_heads: int, field: str = "tensor_parallel_size") -> None:
    """Raise `InvalidInputError` naming `field` unless 1 <= world_size <= num_heads (every rank
    needs at least one query head)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(field, f"must be an integer >= 1; got {world_size!r}")
    if world_size > num_heads:
        raise InvalidInputError(
            field,
            f"must be between 1 and the model's num_attention_heads ({num_heads}); "
            f"got {world_size}",
        )


def split(total: int, parts: int, index: int, align: int = 1) -> tuple[int, int]:
    """[start, end) of part `index` of `total` split into `parts` contiguous pieces as evenly
    as whole units of `align` allow (sizes differ by at most one unit)."""
    if total % align:
        align = 1
    units = total // align
    return index * units // parts * align, (index + 1) * units // parts * align


def kv_head_range(num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the model's KV heads that `rank` of `world_size` caches (see the module
    docstring: whole groups, or one replicated head when world_size > num_kv_heads)."""
    start = rank * num_kv_heads // world_size
    return start, max((rank + 1) * num_kv_heads // world_size, start + 1)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads [q_start, q_end), KV heads [kv_start, kv_end);
    local query head i reads local KV head i // (query heads / KV heads of this rank)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """The heads `rank` holds (see the module docstring); `check_tp_size` first."""
    check_tp_size(world_size, num_heads)
    group = num_heads // num_kv_heads  # query heads per KV head
    kv_start, kv_end = kv_head_range(num_kv_heads, world_size, rank)
    if world_size <= num_kv_heads:
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    # The ranks that share KV head `kv_start` split its group's query heads between them.
    first = -(-kv_start * world_size // num_kv_heads)  # ceil(kv * N / K)
    last = -(-(kv_start + 1) * world_size // num_kv_heads)
    lo, hi = split(group, last - first, rank - first)
    return HeadShard(kv_start * group + lo, kv_start * group + hi, kv_start, kv_end)


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank reads: [start, end) along `dim` (0: rows,
    the output features of a linear; 1: columns, its input features)."""

    dim: int
    start: int
    end: int


@dataclass(frozen=True)
class ExpertExchange:
    """The ranks that exchange (token, choice) rows for their routed experts by all-to-all,
    each running attention on its own tokens (engine/model/moe_exchange.py): this one is
    `rank` of `size` in `group` (None only at size 1, which exchanges nothing). `local`: the
    group's shared-memory collectives when its ranks are CPU processes on one machine (the
    all-to-alls then go through them, not gloo's loopback TCP)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    local: LocalCollectives | None = field(default=None, compare=False, repr=False)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the routed experts this rank holds whole."""
        return split(num_experts, self.size, self.rank)

    def all_to_all(
        self, inputs: torch.Tensor, in_splits: list[int], out_splits: list[int]
    ) -> torch.Tensor:
        """Rows [sum(out_splits), ...]: out_splits[s] rows from rank s, in rank order, for
        in_splits[d] rows of `inputs` to rank d."""
        out = inputs.new_empty((sum(out_splits), *inputs.shape[1:]))
        if self.size == 1:
            return out.copy_(inputs)
        if self.local is not None and inputs.device.type == "cpu":
            return self._shared_all_to_all(inputs.contiguous(), in_splits, out_splits, out)
        with COLLECTIVES:
            dist.all_to_all_single(
                out, inputs.contiguous(), out_splits, in_splits, group=self.group
            )
        return out

    def _shared_all_to_all(
        self, inputs: torch.Tensor, in_splits: list[int], out_splits: list[int],
        out: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`all_to_all` as two all-gathers through the shared segment: every rank's splits
        ([source, destination] row counts), then every rank's rows, padded to the most any
        rank sends; each rank copies out its runs. Each rank reads every rank's rows, not only
        those for it: at the few ranks of one machine and a step's rows, a memcpy each (gloo's
        all-to-all took about 200 us on loopback TCP)."""
        assert self.local is not None
        with COLLECTIVES:
            splits = self.local.all_gather(torch.tensor(in_splits, dtype=torch.int64))
            assert splits is not None  # a contiguous CPU tensor always goes
            arriving = splits[:, self.rank].tolist()
            if arriving != list(out_splits):
                raise RuntimeError(f"all_to_all: rank {self.rank} expected {out_splits} rows "
                                   f"from the ranks, they send {arriving}")  # fmt: skip
            most = int(splits.sum(1).max())
            if most == 0:
                return out
            padded = inputs
            if inputs.shape[0] < most:
                padded = inputs.new_empty((most, *inputs.shape[1:]))
                padded[: inputs.shape[0]].copy_(inputs)
            every = self.local.all_gather(padded)  # [size, most, ...]
            assert every is not None
        starts = splits[:, : self.rank].sum(1).tolist()  # where each source's run for me starts
        at = 0
        for source, (start, n) in enumerate(zip(starts, arriving, strict=True)):
            out[at : at + n].copy_(every[source, start : start + n])
            at += n
        return out


@dataclass(frozen=True)
class TensorParallel:
    """This rank's tensor-parallel group (`rank` of `world_size` in `group`) and, with pipeline
    parallelism, its stage (`pp`): the engine's whole layout."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None with world_size 1
    pp: PipelineParallel = NO_PIPELINE
    expert_parallel: bool = False
    """Whether a mixture's routed experts are sharded whole over the group (`expert_range`)
    instead of each expert's intermediate size being sliced (`expert_parallel_size`)."""
    local: LocalCollectives | None = field(default=None, compare=False, repr=False)
    """The collectives through shared memory, when every rank of the group is a CPU process
    on this machine (engine/shm_collectives.py); else gloo's or NCCL's."""
    exchange: ExpertExchange | None = field(default=None, compare=False)
    """Data-parallel attention: the ranks a mixture's routed experts are sharded over whole
    and exchange rows with (engine/model/moe_exchange.py); None: experts on this group."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def shared_segment(self) -> LocalCollectives | None:
        """The data-parallel ranks' shared-memory collectives (CPU ranks on one machine), for
        their commands and reports as well as the exchange; None otherwise."""
        return None if self.exchange is None else self.exchange.local

    @property
    def spans_ranks(self) -> bool:
        """Whether the engine has more than one rank (tensor or pipeline parallel)."""
        return self.enabled or self.pp.enabled

    @property
    def global_rank(self) -> int:
        """This rank among all the engine's ranks (stage x TP size + TP rank)."""
        return self.pp.global_rank if self.pp.enabled else self.rank

    @property
    def is_leader(self) -> bool:
        """Whether this rank takes the engine's commands: TP rank 0 of the first stage."""
        return self.rank == 0 and self.pp.is_first

    @property
    def samples(self) -> bool:
        """Whether this rank samples: TP rank 0 of the last stage."""
        return self.rank == 0 and self.pp.is_last

    def broadcast_sampled(self, x: torch.Tensor) -> torch.Tensor:
        """The sampling rank's `x` (a step's host transfer) on every rank of the engine."""
        if self.pp.enabled:
            return self.pp.broadcast_from_sampler(x)
        return self.broadcast_from_first(x)

    def agree_min_all(self, value: int, device: torch.device) -> int:
        """The smallest `value` over every rank of the engine (all stages)."""
        if self.pp.enabled:
            return self.pp.agree_min(value, device)
        return self.agree_min(value, device)

    def split(self, total: int, align: int = 1) -> tuple[int, int]:
        """[start, end) of this rank's share of `total` (`split`)."""
        return split(total, self.world_size, self.rank, align)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[start, end) of the routed experts this rank holds whole: a contiguous 1/N of them
        with expert parallelism (`check_ep_size` first), all of them (sliced) without."""
        if self.exchange is not None:
            return self.exchange.expert_range(num_experts)
        if not self.expert_parallel:
            return 0, num_experts
        return split(num_experts, self.world_size, self.rank)

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return head_shard(num_heads, num_kv_heads, self.world_size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            with COLLECTIVES:
                if self.local is None or not self.local.all_reduce(x):
                    dist.all_reduce(x, group=self.group)
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the group's ranks (every rank must call it at the same
        point). `device`: the engine's (NCCL reduces CUDA tensors, gloo CPU ones)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        with COLLECTIVES:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            return int(t.item())

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's `x` ([N, sizes[rank]]) concatenated along the last dimension, in rank
        order, on rank 0 only (None elsewhere): the LM head's logits go to the rank that
        samples, not to every rank. Shards are padded to the largest for the collective."""
        if not self.enabled:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        stacked = None
        if self.local is not None:
            with COLLECTIVES:
                stacked = self.local.all_gather(x)  # every rank's, kept by rank 0 only
        if stacked is not None:
            parts = list(stacked.unbind(0)) if self.rank == 0 else None
        else:  # gloo's gather (or NCCL's), where the shared segment does not take x
            parts = (
                [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
            )
            with COLLECTIVES:
                dist.gather(x, parts, group=self.group, group_dst=0)
        if parts is None:
            return None
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; the others pass a buffer of its shape)."""
        if self.enabled:
            with COLLECTIVES:
                if self.local is None or not self.local.broadcast(x):
                    dist.broadcast(x, group=self.group, group_src=0)
        return x

    def broadcast_commands(self, commands: Any, control_group: dist.ProcessGroup | None) -> Any:
        """Rank 0's iteration commands (a list) on every rank of the engine, over
        `control_group`: through shared memory when that is this TP group on one machine
        (no pipeline stages), else gloo's object broadcast."""
        with COLLECTIVES:
            if self.local is not None and control_group is self.group:
                return self.local.broadcast_object(commands)
            box = [commands]
            dist.broadcast_object_list(box, group=control_group, group_src=0)
            return box[0]


SINGLE = TensorParallel()
