"""What a prefill-only request hands over: `PrefillDone` (the blocks, first token and seed the
decode side needs) and `PrefillStream` (the hook that ships KV layer by layer)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from duet.engine.outputs import PromptLogprob
from duet.engine.request import Request


@dataclass(frozen=True)
class PrefillDone:
    """A `prefill_only` request reached its first token: what the decode side needs to go on.
    Its blocks stay held (see `LLMEngine.release_held`)."""

    request_id: str
    block_ids: list[int]  # covering the prompt's KV, in order
    first_token: int
    logprob: tuple[float, list[tuple[int, float]]] | None  # as the sampler returns it
    sample_seed: int  # keys the request's draws; the decode side continues with it
    num_cached_tokens: int  # prompt tokens that were prefix-cache hits here
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one entry per prompt token (the first None),
    as `ModelRunner` computes them: (logprob, rank, top [(id, logprob)])."""

    @classmethod
    def of(
        cls,
        request: Request,
        block_ids: list[int],
        logprob: tuple[float, list[tuple[int, float]]] | None,
        prompt_logprobs: list[PromptLogprob | None] | None,
    ) -> PrefillDone:
        """The hand-off of a request that just reached its first token."""
        first, seed = request.output_token_ids[-1], request.sample_seed
        cached = max(0, request.num_cached_tokens)
        return cls(request.request_id, block_ids, first, logprob, seed, cached, prompt_logprobs)


class PrefillStream(Protocol):
    """Layer-wise hand-off of prefill-only requests' KV (a prefill worker sets one on its
    engine as `LLMEngine.prefill_stream`)."""

    def begin(self, requests: list[tuple[str, list[int]]]) -> Callable[[int], None] | None:
        """Called before a forward pass with the (request id, block ids) of the prefill-only
        requests whose prompts it completes (each reaches `take_prefilled` after the pass).
        Returns the pass's per-layer callback (see `LlamaForCausalLM.forward`), or None."""
        ...
