"""Tensor parallelism: which shard of each weight a rank holds, and the collectives that join
the shards (`torch.distributed`: gloo on CPU, NCCL on GPU).

Layout (Megatron style): q/k/v and gate/up are column-parallel (a rank holds its heads / its
slice of the intermediate size), o_proj and down_proj are row-parallel (partial sums,
all-reduced), the embedding and LM head are vocab-parallel. Each rank keeps only the KV heads of
its shard in its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from duet.engine.errors import InvalidInputError


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # None with world_size 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, total: int, name: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` rows."""
        if total % self.world_size:
            raise InvalidInputError(
                "tensor_parallel_size",
                f"{name}={total} is not divisible by tensor_parallel_size={self.world_size}",
            )
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the group's ranks (every rank must call it at the same
        point). `device`: the engine's (NCCL reduces CUDA tensors, gloo CPU ones)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (rank order)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
