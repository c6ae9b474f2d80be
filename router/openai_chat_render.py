"""A chat turn's events (router/chat_events.py) in OpenAI's chat-completion shapes: streamed
chunks (REST/SSE, and a background request's log replayed) and the whole response (REST
without `stream`, the Batch API, a background request's result)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from duet.engine import TokenLogprobs
from duet.router.chat_events import (
    ChatStep,
    Final,
    Finish,
    PromptLogprobs,
    ReasoningDelta,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
)
from duet.router.chat_events import Usage as TurnUsage
from duet.router.logprobs import TokenTexts, chat_logprobs, prompt_logprobs
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    Usage,
)


@dataclass
class ChatCompletionRender:
    """One request's rendering: its id, model and logprob options."""

    request_id: str
    model: str
    texts: TokenTexts
    created: int
    logprobs: bool = False
    top_logprobs: int = 0
    as_ids: bool = False
    """`return_tokens_as_token_ids`: tokens in logprobs read `token_id:<id>`."""

    @classmethod
    def of(
        cls,
        body: ChatCompletionRequest,
        request_id: str,
        model: str,
        texts: TokenTexts,
        created: int | None = None,
    ) -> ChatCompletionRender:
        return cls(
            request_id, model, texts, int(time.time()) if created is None else created,
            bool(body.logprobs), body.top_logprobs or 0, body.return_tokens_as_token_ids,
        )  # fmt: skip

    def chunk(
        self,
        choices: list[ChatCompletionStreamChoice],
        usage: TurnUsage | None = None,
        prompt_lps: PromptLogprobs | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=_usage(usage) if usage is not None else None,
            prompt_logprobs=(
                prompt_logprobs(prompt_lps.entries, self.texts, self.as_ids) if prompt_lps else None
            ),
        )

    def chunks(self, step: ChatStep, keep_empty: bool = False) -> list[ChatCompletionChunk]:
        """A step's chunks: the prompt's logprobs, then one per choice that has something to
        show (`keep_empty`: one per choice regardless: a background log's entry each)."""
        out = []
        prompt_lps = step.first(PromptLogprobs)
        if prompt_lps is not None:
            out.append(self.chunk([], prompt_lps=prompt_lps))
        for index, events in step.by_choice():
            text = reasoning = ""
            calls = []
            tokens: TokenDelta | None = None
            finish: Finish | None = None
            for event in events:
                match event:
                    case TokenDelta():
                        tokens = event
                    case TextDelta(_, piece):
                        text += piece
                    case ReasoningDelta(_, piece):
                        reasoning += piece
                    case ToolCallDelta(_, call):
                        calls.append(call)
                    case Finish():
                        finish = event
            logprobs = None
            if self.logprobs and tokens is not None and tokens.logprobs is not None:
                logprobs = self._logprobs(tokens.logprobs) or None
            if not (text or reasoning or calls or logprobs or finish or keep_empty):
                continue  # text held back (maybe a stop string or a tool-call marker)
            delta = DeltaMessage(
                content=text or None, reasoning_content=reasoning or None, tool_calls=calls or None
            )
            choice = ChatCompletionStreamChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish.reason if finish else None,
                stop_reason=finish.stop_reason if finish else None,
            )
            out.append(self.chunk([choice]))
        return out

    def response(self, final: Final) -> ChatCompletionResponse:
        choices = [
            ChatCompletionChoice(
                index=reply.index,
                message=ChatResponseMessage(
                    content=reply.content,
                    reasoning_content=reply.reasoning,
                    tool_calls=reply.tool_calls,
                ),
                logprobs=(
                    chat_logprobs(reply.logprobs, self.top_logprobs, self.texts, self.as_ids)
                    if self.logprobs and reply.logprobs is not None
                    else None
                ),
                finish_reason=reply.finish_reason,
                stop_reason=reply.stop_reason,
            )
            for reply in final.replies
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=_usage(final.usage),
            prompt_logprobs=prompt_logprobs(final.prompt_logprobs, self.texts, self.as_ids),
        )

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        """A chunk's, None when it has none (its tokens were held back)."""
        rendered = chat_logprobs(entries, self.top_logprobs, self.texts, self.as_ids)
        return rendered if rendered.content else None


def _usage(usage: TurnUsage) -> Usage:
    return Usage.of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
