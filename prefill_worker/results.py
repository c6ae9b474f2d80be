"""What a prefill yields: `PrefillResult` (how a request's prefill and transfer ended, for the
router) and `PrefillLoad` (the worker's snapshot for routing). What travels with the KV is
wire/handoff.py's `PrefillHandoff`."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.outputs import PromptLogprob
from duet.kv_transfer import TransferStatus


@dataclass(frozen=True)
class PrefillResult:
    """How a request's prefill ended: DONE (KV acknowledged by the decode side), FAILED (with
    `retryable` when another worker or a retry may succeed) or ABORTED."""

    request_id: str
    status: TransferStatus
    error: str | None = None
    retryable: bool = False
    first_token: int | None = None
    num_cached_tokens: int = 0
    num_transfer_bytes: int = 0  # the request's KV, all TP ranks together
    transfer_s: float = 0.0  # from the end of its prefill to the decode side's acknowledgement
    queued_s: float = 0.0  # from its arrival to the start of the first step computing it
    prompt_logprobs: list[PromptLogprob | None] | None = None  # when the request asked
    num_transfer_chunks: int = 0  # messages of whole layers, rank 0's (every rank sends as many)
    link_gbps: float = 0.0  # rank 0's link to the decode worker, as probed; 0: not measured
    acked_ns: int = 0  # wall clock when the acknowledgement was seen (`transfer_s`'s end); 0: none


@dataclass(frozen=True)
class PrefillLoad:
    """A snapshot for routing, refreshed by the engine thread every iteration."""

    num_waiting: int = 0
    num_running: int = 0
    num_transferring: int = 0
    num_queued_tokens: int = 0  # prompt tokens not yet prefilled
    num_free_blocks: int = 0
    num_blocks: int = 0
