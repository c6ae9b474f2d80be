"""Prompt logprobs on the wire (`PrefillResponse.prompt_logprobs`, worker.proto): the prefill
worker computes them and the router, which answers the client, reads them."""

from __future__ import annotations

from collections.abc import Sequence

from duet.engine.outputs import PromptLogprob
from duet.v1 import worker_pb2


def prompt_logprobs_to_wire(
    entries: Sequence[PromptLogprob | None], prompt_token_ids: Sequence[int]
) -> list[worker_pb2.WorkerTokenLogprobs]:
    """One message per prompt token; an entry that is None (the first) is an empty one."""
    out = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=False):
        if entry is None:
            out.append(worker_pb2.WorkerTokenLogprobs())
            continue
        logprob, rank, top = entry
        out.append(
            worker_pb2.WorkerTokenLogprobs(
                sampled=worker_pb2.WorkerLogprob(token_id=token_id, logprob=logprob, rank=rank),
                top=[
                    worker_pb2.WorkerLogprob(token_id=t, logprob=lp, rank=m + 1)
                    for m, (t, lp) in enumerate(top)
                ],
            )
        )
    return out


def prompt_logprobs_from_wire(
    messages: Sequence[worker_pb2.WorkerTokenLogprobs],
) -> list[PromptLogprob | None] | None:
    """Inverse of `prompt_logprobs_to_wire`; None when there are none."""
    if not messages:
        return None
    return [
        (m.sampled.logprob, m.sampled.rank, [(t.token_id, t.logprob) for t in m.top])
        if m.HasField("sampled")
        else None
        for m in messages
    ]
