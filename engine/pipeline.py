"""Pipeline parallelism: the model's layers split into P stages, each stage a tensor-parallel
group of T ranks, P x T ranks in all (docs/parallelism.md).

Global rank `stage * T + tp_rank`. Stage s runs layers `stage_layers(L, P, s)`; the first
stage also the embedding, the last the final norm and the LM head (a tied head: the embedding
table too). Between stages the hidden and residual streams of a step's tokens move from TP
rank r of stage s to TP rank r of stage s + 1 (point to point, `torch.distributed` over the
world group: gloo on CPU, NCCL on GPU). Rank 0 of the last stage samples and broadcasts the
step's tokens to every rank of every stage, which all schedule alike from the same commands
(broadcast by global rank 0, stage 0's TP rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from duet.engine.collective_clock import COLLECTIVES
from duet.engine.errors import InvalidInputError


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers stage `stage` of `num_stages` holds (as even as they divide;
    later stages take the extra ones)."""
    return stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages


def check_pp_size(num_stages: int, num_layers: int, field: str = "pipeline_parallel_size") -> None:
    """Raise `InvalidInputError` naming `field` unless 1 <= num_stages <= num_layers."""
    if (
        isinstance(num_stages, bool)
        or not isinstance(num_stages, int)
        or not 1 <= num_stages <= num_layers
    ):
        raise InvalidInputError(
            field,
            f"must be an integer between 1 and the model's num_hidden_layers ({num_layers}); "
            f"got {num_stages!r}",
        )


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's place in the pipeline. `group`: every rank of every stage (None with one
    stage)."""

    stage: int = 0
    num_stages: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.num_stages > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def global_rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.num_stages * self.tp_size

    @property
    def sampler_rank(self) -> int:
        """The global rank that samples: TP rank 0 of the last stage."""
        return (self.num_stages - 1) * self.tp_size

    def layers(self, num_layers: int) -> tuple[int, int]:
        return stage_layers(num_layers, self.num_stages, self.stage)

    def send_next(self, *tensors: torch.Tensor) -> list[dist.Work]:
        """To the same TP rank of the next stage, in order (it calls `recv_prev` alike),
        without waiting: the caller keeps the tensors and waits on the returned works before
        it reuses or frees them (`wait_all`), so this stage computes its next micro-batch
        while they travel."""
        dst = self.global_rank + self.tp_size
        works = []
        with COLLECTIVES:
            for t in tensors:
                work = dist.isend(t.contiguous(), dst, group=self.group)
                if work is not None:
                    works.append(work)
        return works

    def recv_prev(self, *buffers: torch.Tensor) -> None:
        """From the same TP rank of the previous stage, into `buffers`, in order."""
        src = self.global_rank - self.tp_size
        with COLLECTIVES:
            for b in buffers:
                dist.recv(b, src, group=self.group)

    def broadcast_from_sampler(self, x: torch.Tensor) -> torch.Tensor:
        """The sampling rank's `x` on every rank (in place)."""
        if self.enabled:
            with COLLECTIVES:
                dist.broadcast(x, self.sampler_rank, group=self.group)
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over every rank of every stage."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        with COLLECTIVES:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            return int(t.item())


MIN_MICRO_BATCH_TOKENS = 128
"""Fewest tokens a micro-batch gets. A micro-batch reads all of its stage's weights as the
whole batch would, so splitting pays only where a step's time grows with its tokens (prefill
chunks), not for a memory-bound decode step: with P stages and M micro-batches a step takes
(M + P - 1) micro-batch times against P whole-batch ones."""


def micro_batches(num_reqs: int, num_stages: int, num_tokens: int) -> list[tuple[int, int]]:
    """[start, end) of the step's requests in each micro-batch, in the step's order, as even as
    they divide: as many as stages, but no more than the requests and not below
    `MIN_MICRO_BATCH_TOKENS` tokens each on average (a decode step of a few requests is one)."""
    count = max(1, min(num_reqs, num_stages, num_tokens // MIN_MICRO_BATCH_TOKENS))
    return [stage_layers(num_reqs, count, m) for m in range(count)]


def wait_all(works: list[dist.Work]) -> None:
    with COLLECTIVES:
        for work in works:
            work.wait()
    works.clear()


NO_PIPELINE = PipelineParallel()
