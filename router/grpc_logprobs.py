"""Engine logprobs as duet.v1 messages (generated tokens' and the prompt's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from duet.engine import Logprob
from duet.v1 import serving_pb2


def _one_logprob(x: Any) -> serving_pb2.TokenLogprob:
    return serving_pb2.TokenLogprob(
        token_id=x.token_id, logprob=x.logprob, token=x.token, rank=x.rank or 0
    )


def logprobs_to_proto(lp: Any) -> serving_pb2.TokenLogprobs:
    return serving_pb2.TokenLogprobs(
        sampled=_one_logprob(lp.sampled), top=[_one_logprob(t) for t in lp.top]
    )


def prompt_logprobs_to_proto(
    entries: Sequence[dict[int, Logprob] | None], k: int
) -> list[serving_pb2.TokenLogprobs]:
    """`RequestOutput.prompt_logprobs` as `GenerateResponse.prompt_logprobs`: `sampled` the
    prompt token, `top` the `k` most likely in rank order (the first entry empty)."""
    out = []
    for entry in entries:
        if entry is None:
            out.append(serving_pb2.TokenLogprobs())
            continue
        token = next(iter(entry.values()))  # the prompt token comes first
        top = sorted((lp for lp in entry.values() if lp.rank and lp.rank <= k), key=_rank)
        out.append(
            serving_pb2.TokenLogprobs(
                sampled=_one_logprob(token), top=[_one_logprob(t) for t in top]
            )
        )
    return out


def _rank(lp: Logprob) -> int:
    return lp.rank or 0
