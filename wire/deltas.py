"""Tokens on the wire: what one engine step added to a request, from a decode worker to the
router (`duet.v1.OutputDelta`), and the prompt logprobs a prefill worker computes
(`PrefillResponse.prompt_logprobs`). Token ids and logprobs only: the router detokenizes once
(its `OutputAssembler`), names the tokens in logprobs and applies stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from duet.engine.outputs import EngineOutput, PromptLogprob, SampleDelta, TokenLogprob
from duet.v1 import worker_pb2


def delta_of(out: EngineOutput) -> worker_pb2.OutputDelta:
    """A one-sample request's step (the decode worker runs one sample per request)."""
    [sample] = out.samples
    delta = worker_pb2.OutputDelta(
        token_ids=sample.token_ids,
        finish_reason=sample.finish_reason or "",
        num_cached_tokens=out.num_cached_tokens,
    )
    if sample.logprobs is not None:
        delta.logprobs.extend(_token_logprobs(lp) for lp in sample.logprobs)
    if sample.stop_reason is not None:
        delta.stop_token_id = sample.stop_reason
    if out.embedding is not None:
        delta.embedding.extend(out.embedding)
    return delta


def sample_delta_of(delta: worker_pb2.OutputDelta, index: int) -> SampleDelta:
    """The router's view of a worker's delta, as sample `index` of its request."""
    logprobs: list[TokenLogprob | None] | None = None
    if delta.logprobs:
        logprobs = [
            (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top])
            if lp.HasField("sampled")
            else None
            for lp in delta.logprobs
        ]
    stop_token = delta.stop_token_id if delta.HasField("stop_token_id") else None
    return SampleDelta(
        index, list(delta.token_ids), logprobs, delta.finish_reason or None, stop_token
    )


def _token_logprobs(lp: TokenLogprob | None) -> worker_pb2.WorkerTokenLogprobs:
    if lp is None:  # a token without them (the request asked; this one has none)
        return worker_pb2.WorkerTokenLogprobs()
    chosen, top = lp
    return worker_pb2.WorkerTokenLogprobs(
        sampled=worker_pb2.WorkerLogprob(logprob=chosen),
        top=[worker_pb2.WorkerLogprob(token_id=t, logprob=v) for t, v in top],
    )


def prompt_logprobs_to_proto(
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


def prompt_logprobs_from_proto(
    messages: Sequence[worker_pb2.WorkerTokenLogprobs],
) -> list[PromptLogprob | None] | None:
    """Inverse of `prompt_logprobs_to_proto`; None when there are none."""
    if not messages:
        return None
    return [
        (m.sampled.logprob, m.sampled.rank, [(t.token_id, t.logprob) for t in m.top])
        if m.HasField("sampled")
        else None
        for m in messages
    ]
