"""`ClusterSample`: one of a request's `n` samples as the router runs it, and how a decode
worker's token deltas fold into it."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.llm_engine import EngineStats
from duet.engine.output_processor import OutputAssembler
from duet.engine.outputs import SampleDelta, TokenLogprob
from duet.engine.request import Request
from duet.v1 import worker_pb2


@dataclass
class ClusterSample:
    """The engine `Request` that holds the sample's budget and the tokens streamed so far (a
    lost decode worker's successor continues from them), and the request's `OutputAssembler`,
    which makes the text."""

    index: int
    request: Request
    assembler: OutputAssembler

    @property
    def finish_reason(self) -> str | None:
        return self.assembler.samples[self.index].finish_reason

    def apply(self, delta: worker_pb2.OutputDelta, stats: EngineStats) -> bool:
        """Fold a worker's delta into the sample; True when anything changed."""
        request = self.request
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = delta.num_cached_tokens
            stats.prefix_cache_hits += delta.num_cached_tokens
        if not delta.token_ids and not delta.finish_reason:
            return False
        stop_token = None
        if delta.finish_reason and delta.WhichOneof("stop_reason") == "stop_token_id":
            request.stop_reason = stop_token = delta.stop_token_id
        logprobs: list[TokenLogprob | None] = [
            (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in delta.logprobs
        ]
        tokens = self.assembler.samples[self.index].token_ids
        before = len(tokens)
        finish = delta.finish_reason or None
        ids = list(delta.token_ids)
        self.assembler.add_sample(SampleDelta(self.index, ids, logprobs, finish, stop_token))
        for token in tokens[before:]:  # up to a stop string's last token
            request.append_output_token(token)
        stats.num_generated_tokens += len(tokens) - before
        return True
