"""`RankAgreement`: the ranks of one tensor-parallel worker agree on each transfer's outcome.

Every rank of a prefill or decode worker moves its own heads of a request's KV
(`layout.head_route`), so each rank's sender or receiver learns the outcome of its own part,
each at its own time. What the engine does with an outcome (free the prefill blocks, start
decoding) changes the scheduler, which every rank runs identically from the same inputs
(docs/parallelism.md): so an outcome becomes an input only once every rank has one, and then
on every rank at the same point, the same. Each rank `record`s what its poll reported; at the
same point of every iteration all ranks `settle` the same list of requests in flight, one
all-reduce over the group: a request is settled when every rank has an outcome, and its outcome
is the worst of them (FAILED, not retryable > FAILED > ABORTED > DONE). With `share_meta`, the
metadata of the settled DONE requests is rank 0's (one broadcast, in iterations that settle
one), so every rank starts decoding from the same first token.

Thread: the engine thread only; `settle` is a collective (every rank calls it with the same
list, never an empty one on some ranks only).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from duet.kv_transfer.base import TransferResult, TransferStatus


class _Code(enum.IntEnum):
    """A rank's outcome, ordered from best to worst."""

    NONE = 0
    DONE = 1
    ABORTED = 2
    FAILED = 3
    FAILED_FINAL = 4


def _code(result: TransferResult) -> _Code:
    if result.status == TransferStatus.DONE:
        return _Code.DONE
    if result.status == TransferStatus.ABORTED:
        return _Code.ABORTED
    return _Code.FAILED if result.retryable else _Code.FAILED_FINAL


class RankAgreement:
    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        share_meta: bool = False,
    ) -> None:
        """`group`: a gloo group over the worker's ranks (the command broadcast's)."""
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.share_meta = share_meta
        self._local: dict[str, TransferResult] = {}

    def record(self, result: TransferResult) -> None:
        """This rank's outcome for its part of a transfer (its first word stands)."""
        self._local.setdefault(result.request_id, result)

    def settle(self, in_flight: Sequence[str]) -> list[TransferResult]:
        """The outcomes of the requests of `in_flight` (the same list, in the same order, on
        every rank) that every rank has one for, in that order; outcomes recorded for requests
        no longer in flight are dropped. A collective when the worker has several ranks and
        `in_flight` is not empty."""
        self._drop_stale(in_flight)
        if not in_flight:
            return []
        codes = [_code(r) if (r := self._local.get(i)) else _Code.NONE for i in in_flight]
        if self.world_size > 1:
            n = len(in_flight)
            # one MIN-reduction: [every rank has one (0/1)] + [-(the worst outcome)]
            t = torch.tensor([int(c > 0) for c in codes] + [-int(c) for c in codes])
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            codes = [_Code(-int(t[n + i])) if int(t[i]) else _Code.NONE for i in range(n)]
        settled = []
        for request_id, code in zip(in_flight, codes, strict=True):
            if code == _Code.NONE:
                continue
            local = self._local.pop(request_id)
            settled.append(local if _code(local) == code else _agreed(request_id, code))
        if self.share_meta and self.world_size > 1:
            settled = self._rank0_meta(settled)
        return settled

    def _drop_stale(self, in_flight: Sequence[str]) -> None:
        """Outcomes of requests no longer in flight (aborted meanwhile) are nobody's input."""
        live = set(in_flight)
        for request_id in [i for i in self._local if i not in live]:
            del self._local[request_id]

    def _rank0_meta(self, settled: list[TransferResult]) -> list[TransferResult]:
        """Rank 0's metadata for the DONE ones (a broadcast, only when there are any)."""
        done = [i for i, r in enumerate(settled) if r.status == TransferStatus.DONE]
        if not done:
            return settled
        box: list[object] = [[settled[i].meta for i in done]]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        metas = box[0]
        assert isinstance(metas, list)
        out = list(settled)
        for i, meta in zip(done, metas, strict=True):
            out[i] = dataclasses.replace(settled[i], meta=meta)
        return out


def _agreed(request_id: str, code: _Code) -> TransferResult:
    """The group's outcome where this rank's own part went better."""
    if code == _Code.ABORTED:
        return TransferResult(request_id, TransferStatus.ABORTED)
    return TransferResult(
        request_id,
        TransferStatus.FAILED,
        "the transfer of another tensor-parallel rank's KV heads failed",
        retryable=code == _Code.FAILED,
    )
