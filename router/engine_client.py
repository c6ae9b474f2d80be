"""`EngineClient`: what the front ends (REST, gRPC, metrics) need of whatever runs requests:
one in-process `AsyncEngine` (aggregated mode) or the router's view of a cluster of prefill
and decode workers (`router.cluster.ClusterEngine`, disaggregated mode)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from duet.engine import RequestOutput, SamplingParams
from duet.engine.llm_engine import EngineStats, Prompt
from duet.engine.tokenizer import Message, Tokenizer


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Sequences that run at once: the admission controller's capacity."""

    @property
    def is_running(self) -> bool:
        """False once it stopped for good (liveness)."""

    @property
    def deterministic(self) -> bool:
        """Whether a request's tokens are independent of batching, chunking, prefix-cache hits
        and (in a cluster) disaggregation (docs/determinism.md)."""

    @property
    def speculates_with_ngram(self) -> bool:
        """Whether a request's `prediction_token_ids` (Predicted Outputs) are used: the engine
        proposes by ngram lookup."""

    @property
    def declared_pooling(self) -> str | None:
        """How the model's sentence-transformers configuration pools an embedding (`last`,
        `mean`, `cls`, or one duet does not compute), or None: it declares none."""

    @property
    def computes_embeddings(self) -> bool:
        """Whether requests with `SamplingParams.pooling` (`/v1/embeddings`) are served: an
        engine that runs the whole model in one place does."""

    @property
    def is_ready(self) -> bool:
        """True while new requests can be served (readiness)."""

    @property
    def stats(self) -> EngineStats:
        """Gauges and counters for /metrics, read on each scrape."""

    def tokenize_prompt(self, prompt: Prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        """(text, ids); raises `InvalidInputError` for an empty prompt or bad ids, and
        (`bounded`) for a text provably too long for the context, before tokenizing it."""

    def encode_chat(self, messages: list[Message]) -> list[int]: ...

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The effective max_tokens; raises `InvalidInputError` when it cannot fit."""

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving early aborts it. Failures raise
        `EngineDeadError` (retryable elsewhere)."""

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop; in-flight streams end with `EngineDeadError`."""

    async def start(self) -> None:
        """Start background work on the server's event loop (called once at startup)."""

    async def stop(self) -> None:
        """End that background work at server shutdown."""
