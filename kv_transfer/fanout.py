"""`FanOutKVSender`: one prefill rank's sender to decode workers of any tensor parallelism.

A decode worker's KV address names the receiver of each of its ranks, in rank order, joined
by commas (`join_addresses`; one address for a worker of one rank). This prefill rank ships
each decode rank the KV heads `layout.head_route` gives it, so every decode rank receives
exactly the heads it caches, each once: it sends to the decode ranks whose route is not empty,
and to no other. Each decode rank index has a backend sender of its own (made on first use):
a backend keys its transfers by request id, which is the same on every decode rank.
With pipeline stages this rank's caches are its stage's layers: the engine names the model's
layer as each is computed (`layer_computed`), the backends this stage's (from 0).

A request's one outcome is reported once every part of it is over (no backend thread reads its
blocks then): DONE when every part is, FAILED when one failed (retryable when every failed part
is), ABORTED otherwise. A prefill rank that ships no heads at all (a replicated KV head a lower
rank ships) reports DONE at once; the group's ranks agree on the outcome
(`kv_transfer/rank_agreement.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duet.kv_transfer.base import KVSender, TransferResult, TransferStatus
from duet.kv_transfer.layout import HandshakeError, KVLayout, head_route

logger = logging.getLogger(__name__)

ADDRESS_SEPARATOR = ","


def join_addresses(addresses: list[str]) -> str:
    """A decode worker's KV address: its ranks' receivers, in rank order."""
    if not addresses or any(not a or ADDRESS_SEPARATOR in a for a in addresses):
        raise ValueError(f"addresses: one non-empty address per rank, no commas; got {addresses}")
    return ADDRESS_SEPARATOR.join(addresses)


def split_addresses(dest: str) -> list[str]:
    """The receivers of each rank of the decode worker at `dest`, in rank order."""
    addresses = dest.split(ADDRESS_SEPARATOR)
    if not all(addresses):
        raise ValueError(f"dest: an empty address among {dest!r}")
    return addresses


@dataclass
class _Parts:
    """One request's transfers, one per decode rank it goes to, until each reported."""

    open: set[int]  # decode rank indices not yet reported
    results: list[TransferResult] = field(default_factory=list)


class FanOutKVSender(KVSender):
    """A `KVSender` over `make(k)`, the backend sender to decode rank index k. One thread (the
    engine's) calls every method, as for any sender."""

    def __init__(self, make: Callable[[int], KVSender], layout: KVLayout) -> None:
        self._make = make
        self.layout = layout
        self._senders: dict[int, KVSender] = {}
        self._parts: dict[str, _Parts] = {}
        self._results: list[TransferResult] = []
        self._streaming: set[int] = set()  # senders with layer-wise transfers this pass

    def sender(self, index: int) -> KVSender:
        """The backend sender to decode rank `index` (made now if it is not yet)."""
        sender = self._senders.get(index)
        if sender is None:
            sender = self._senders[index] = self._make(index)
        return sender

    def targets(self, dest: str) -> list[tuple[int, str]]:
        """(decode rank, its receiver) of each rank of the decode worker at `dest` this rank
        ships heads to."""
        addresses = split_addresses(dest)
        receiver = dataclasses.replace(
            self.layout, tp_size=len(addresses), draft=None, pp_size=1, pp_stage=0
        )
        return [
            (k, address)
            for k, address in enumerate(addresses)
            if head_route(self.layout, receiver.rank(k)) is not None
        ]

    # -- worker side -------------------------------------------------------------------------

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        self._open(
            request_id, dest,
            lambda s, address: s.send(request_id, block_ids, address, meta, draft_block_ids),
        )  # fmt: skip

    def begin(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        draft_block_ids: list[int] | None = None,
    ) -> bool:
        targets = self.targets(dest)
        if targets and not self.sender(targets[0][0]).begin(
            request_id, block_ids, targets[0][1], draft_block_ids
        ):
            return False  # this backend sends whole requests: `send` after the pass
        began = {targets[0][0]} if targets else set()
        self._parts[request_id] = _Parts(set(began))
        self._streaming |= began
        try:
            for k, address in targets[1:]:
                self.sender(k).begin(request_id, block_ids, address, draft_block_ids)
                self._parts[request_id].open.add(k)
                self._streaming.add(k)
        except Exception as e:
            self._fail_rest(request_id, e)
        self._settle(request_id)
        return True

    def layer_computed(self, layer: int) -> None:
        """`layer`: the model's index; the backends count this stage's layers from 0."""
        local = layer - self.layout.layer_range[0]
        for k in self._streaming:
            self._senders[k].layer_computed(local)
        if local == self.layout.num_local_layers - 1:
            self._streaming = set()

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:
        parts = self._parts.get(request_id)
        for k in sorted(parts.open) if parts is not None else []:
            self._senders[k].finish(request_id, meta)

    def abort(self, request_id: str) -> None:
        parts = self._parts.get(request_id)
        for k in sorted(parts.open) if parts is not None else []:
            self._senders[k].abort(request_id)

    def _open(self, request_id: str, dest: str, start: Callable[[KVSender, str], None]) -> None:
        """Start a part per target; the first one's error propagates as a lone sender's would
        (nothing was opened), a later one's fails the request once the opened parts are over."""
        targets = self.targets(dest)
        parts = self._parts[request_id] = _Parts(set())
        for i, (k, address) in enumerate(targets):
            try:
                start(self.sender(k), address)
            except Exception as e:
                if i == 0:
                    del self._parts[request_id]
                    raise
                self._fail_rest(request_id, e)
                break
            parts.open.add(k)
        self._settle(request_id)

    def _fail_rest(self, request_id: str, error: Exception) -> None:
        """A part could not open: the request fails, once the parts already open are over."""
        logger.error("KV transfer of %s to one of its decode ranks failed: %s", request_id, error)
        retryable = not isinstance(error, HandshakeError)
        self._parts[request_id].results.append(
            TransferResult(request_id, TransferStatus.FAILED, str(error), retryable)
        )
        self.abort(request_id)

    # -- scheduler side ----------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        for k, sender in self._senders.items():
            for result in sender.poll():
                parts = self._parts.get(result.request_id)
                if parts is None or k not in parts.open:
                    logger.warning("KV transfer outcome for %s: not open", result.request_id)
                    continue
                parts.open.discard(k)
                parts.results.append(result)
                if result.status != TransferStatus.DONE:
                    self.abort(result.request_id)  # the others need not finish
                self._settle(result.request_id)
        out, self._results = self._results, []
        return out

    def _settle(self, request_id: str) -> None:
        """Report the request once every part is over."""
        parts = self._parts[request_id]
        if parts.open:
            return
        del self._parts[request_id]
        self._results.append(combine(request_id, parts.results))

    def link_gbps(self, dest: str) -> float | None:
        targets = self.targets(dest)
        if not targets or targets[0][0] not in self._senders:
            return None
        return self._senders[targets[0][0]].link_gbps(targets[0][1])

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()


def combine(request_id: str, results: list[TransferResult]) -> TransferResult:
    """One request's outcome from its parts' (none: this rank had nothing to ship)."""
    failed = [r for r in results if r.status == TransferStatus.FAILED]
    chunks = sum(r.num_chunks for r in results)
    gbps = next((r.link_gbps for r in results if r.link_gbps is not None), None)
    if failed:
        return TransferResult(
            request_id, TransferStatus.FAILED, "; ".join(str(r.error) for r in failed),
            all(r.retryable for r in failed), num_chunks=chunks, link_gbps=gbps,
        )  # fmt: skip
    if any(r.status == TransferStatus.ABORTED for r in results):
        return TransferResult(request_id, TransferStatus.ABORTED, num_chunks=chunks)
    return TransferResult(request_id, TransferStatus.DONE, num_chunks=chunks, link_gbps=gbps)
