"""`ServingContext`: what every route shares: the engine, the served name, admission, metrics,
sessions and rate limits.

`generate()` is the one way routes run a request: it records metrics and gives the admission
ticket back however the request ends (finished, failed, client gone), and leaving it early
aborts the engine request so its KV blocks are freed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import cast

from duet.engine import InvalidInputError, RequestOutput, SamplingParams
from duet.router.admission import AdmissionController, AdmissionTicket
from duet.router.engine_client import EngineClient
from duet.router.errors import BadRequestError, EngineUnavailableError, ModelNotFoundError
from duet.router.logprobs import TokenTexts
from duet.router.metrics import ServingMetrics
from duet.router.openai_chat import ChatOptions
from duet.router.rate_limit import RequestRateLimiter
from duet.router.sessions import SessionManager
from duet.router.tracing import RequestTracing
from duet.telemetry.request_trace import REQUEST_TRACE


class ServingContext:
    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str | Sequence[str],
        admission: AdmissionController,
        sessions: SessionManager,
        rate_limiter: RequestRateLimiter,
        chat_options: ChatOptions | None = None,
        metrics_prefix: str = "duet",
        tracing: RequestTracing | None = None,
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.rate_limiter = rate_limiter
        names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
        self.model_names: tuple[str, ...] = tuple(names)
        """Every id clients may send (vLLM's several `--served-model-name`s)."""
        if not self.model_names or not all(self.model_names):
            raise ValueError(f"served_model_name: must be non-empty names; got {names!r}")
        self.model_name = self.model_names[0]
        """The id responses carry and metrics are labelled with (the first)."""
        self.created = int(time.time())
        self.admission = admission
        self.metrics = ServingMetrics(engine, self.model_name, metrics_prefix)
        self.token_texts = TokenTexts(engine.tokenizer)
        self.chat_options = chat_options or ChatOptions()
        """Tool-call and reasoning parsers (router/openai_chat.py)."""
        self.tracing = tracing or RequestTracing()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise ModelNotFoundError(
                f"model {model!r} does not exist; this server serves {served}", param="model"
            )

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise EngineUnavailableError("the engine is not running; retry on another replica")

    def check_lengths(
        self, num_prompt_tokens: int, params: SamplingParams, rename: Mapping[str, str]
    ) -> int:
        """The effective max_tokens; 400 when prompt + max_tokens cannot fit the context or
        the KV pool."""
        try:
            return self.engine.check_lengths(num_prompt_tokens, params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None

    def check_priority(self, priority: int) -> None:
        check_priority(self.engine, priority)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        ticket: AdmissionTicket,
        arrival_s: float,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs. The ticket is released when this generator ends.
        `priority`: lower runs first, under the priority scheduling policy."""
        tracker = self.metrics.track(arrival_s, params)
        last: RequestOutput | None = None
        traced = self.tracing.begin(arrival_s)
        # The engine's tasks start in the first step and inherit this context (router/tracing.py).
        token = REQUEST_TRACE.set(traced) if traced is not None else None
        try:
            # EngineClient.generate is an async generator (typed as an iterator): close it.
            outputs = cast(
                AsyncGenerator[RequestOutput, None],
                self.engine.generate(prompt_token_ids, params, request_id, priority),
            )
            async with aclosing(outputs) as it:
                async for out in it:
                    if token is not None:
                        REQUEST_TRACE.reset(token)  # the same step that set it
                        token = None
                    tracker.on_output(out)
                    last = out
                    yield out
        finally:
            if token is not None:
                REQUEST_TRACE.reset(token)
            ticket.release()
            tracker.on_finish(last)
            if traced is not None:
                self.tracing.finish(traced, _span_attributes(request_id, self.model_name, last))


def _span_attributes(
    request_id: str, model_name: str, last: RequestOutput | None
) -> dict[str, str | int]:
    attributes: dict[str, str | int] = {"duet.request_id": request_id, "duet.model": model_name}
    if last is not None:
        attributes["duet.prompt_tokens"] = len(last.prompt_token_ids)
        attributes["duet.generated_tokens"] = sum(len(c.token_ids) for c in last.outputs)
        attributes["duet.finish_reason"] = last.outputs[0].finish_reason or "abort"
    return attributes


def check_priority(engine: EngineClient, priority: int) -> None:
    """400 for a priority `engine` would ignore (it schedules first come, first served)."""
    policy = getattr(engine, "scheduling_policy", "fcfs")
    if priority != 0 and policy != "priority":
        raise BadRequestError(
            f"priority: this server schedules {policy} and would ignore it (start it with "
            "--scheduling-policy priority)",
            param="priority",
        )


async def final_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """Drain a request's stream; its last output holds every sample's full result."""
    last: RequestOutput | None = None
    async with aclosing(outputs) as it:
        async for out in it:
            last = out
    if last is None:
        raise RuntimeError("the engine ended a request without any output")
    return last
