"""`ClusterSample`: one of a request's `n` samples as the router runs it, and how a decode
worker's token deltas fold into it."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.llm_engine import EngineStats
from duet.engine.output_processor import OutputAssembler
from duet.engine.request import Request
from duet.v1 import worker_pb2
from duet.wire.deltas import sample_delta_of


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
        if delta.embedding:
            self.assembler.embedding = list(delta.embedding)
        if not delta.token_ids and not delta.finish_reason:
            return False
        step = sample_delta_of(delta, self.index)
        if step.stop_reason is not None:
            request.stop_reason = step.stop_reason
        tokens = self.assembler.samples[self.index].token_ids
        before = len(tokens)
        self.assembler.add_sample(step)
        for token in tokens[before:]:  # up to a stop string's last token
            request.append_output_token(token)
        stats.num_generated_tokens += len(tokens) - before
        return True
