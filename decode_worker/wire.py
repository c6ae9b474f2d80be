"""`RequestOutput` <-> `duet.v1.OutputDelta`: what one step added to a request, on the wire
from a decode worker to the router, and folded back into cumulative outputs there."""

from __future__ import annotations

from duet.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from duet.v1 import worker_pb2


def to_delta(out: RequestOutput) -> worker_pb2.OutputDelta:
    """The new part of a one-sample output (its `delta_*` fields and the new logprobs)."""
    sample = out.outputs[0]
    delta = worker_pb2.OutputDelta(
        token_ids=sample.delta_token_ids,
        text=sample.delta_text,
        finish_reason=sample.finish_reason or "",
        num_cached_tokens=out.num_cached_tokens,
    )
    if sample.logprobs is not None and sample.delta_token_ids:
        for lp in sample.logprobs[len(sample.token_ids) - len(sample.delta_token_ids) :]:
            delta.logprobs.append(
                worker_pb2.WorkerTokenLogprobs(
                    sampled=_to_wire(lp.sampled), top=[_to_wire(t) for t in lp.top]
                )
            )
    if isinstance(sample.stop_reason, int):
        delta.stop_token_id = sample.stop_reason
    elif isinstance(sample.stop_reason, str):
        delta.stop_string = sample.stop_reason
    return delta


class OutputAccumulator:
    """Folds deltas of one sample into the cumulative `RequestOutput`s the serving code
    reads (text, token_ids, logprobs so far, plus this step's delta)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        index: int = 0,
        want_logprobs: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if want_logprobs else None

    def add(self, delta: worker_pb2.OutputDelta) -> RequestOutput:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(
                TokenLogprobs(_from_wire(lp.sampled), [_from_wire(t) for t in lp.top])
                for lp in delta.logprobs
            )
        which = delta.WhichOneof("stop_reason")
        stop_reason = getattr(delta, which) if which else None
        sample = CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=delta.finish_reason or None,
            stop_reason=stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            delta_text=delta.text,
            delta_token_ids=list(delta.token_ids),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=None,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[sample],
            finished=sample.finished,
            num_cached_tokens=delta.num_cached_tokens,
        )


def _to_wire(lp: Logprob) -> worker_pb2.WorkerLogprob:
    return worker_pb2.WorkerLogprob(token_id=lp.token_id, logprob=lp.logprob, token=lp.token)


def _from_wire(lp: worker_pb2.WorkerLogprob) -> Logprob:
    return Logprob(lp.token_id, lp.logprob, lp.token)
