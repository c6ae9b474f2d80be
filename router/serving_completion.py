"""`POST /v1/completions`: one or more prompts (text or token ids), `n` samples each.

Choice `i * n + j` is sample `j` of prompt `i`, as in vLLM; usage sums over all of them."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from fastapi import Request, Response

from duet.engine import CompletionOutput, InvalidInputError, RequestOutput
from duet.router.auth import caller_api_key
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.errors import BadRequestError, as_openai_error
from duet.router.logprobs import completion_logprobs, echo_logprobs, join_logprobs, prompt_logprobs
from duet.router.openai_protocol import CompletionRequest
from duet.router.openai_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprobs,
    Usage,
)
from duet.router.serving_context import ServingContext
from duet.router.sse import DONE, EventStreamResponse, sse_error, sse_event
from duet.router.stream_merge import merge_streams


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        if body.session_id is not None:
            raise BadRequestError(
                "session_id: sessions hold chat messages; use /v1/chat/completions",
                param="session_id",
            )
        try:
            params = body.to_sampling_params()
            # A prompt to truncate may be longer than the context (the body's size bounds it).
            bounded = body.truncate_prompt_tokens is None
            tokenized = [ctx.engine.tokenize_prompt(p, bounded) for p in body.prompts()]
            if not bounded:  # echo what the model reads
                max_len = ctx.engine.max_model_len
                tokenized = [(None, body.truncated(ids, max_len)) for _, ids in tokenized]
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e) from None
        prompts = [ids for _, ids in tokenized]
        # echo: each choice's text starts with its prompt's text.
        echoes = ["" for _ in tokenized]
        if body.echo:
            echoes = [ctx.engine.tokenizer.decode(ids) if t is None else t for t, ids in tokenized]
        num_tokens = 0
        for ids in prompts:
            num_tokens += len(ids) + ctx.check_lengths(len(ids), params, {}) * params.n
        ctx.check_priority(body.priority)
        ctx.check_engine()
        await ctx.rate_limiter.admit(caller_api_key(raw), num_tokens)
        tickets = ctx.admission.admit([params.n] * len(prompts))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [
            ctx.generate(ids, params, f"{request_id}-{i}", ticket, arrival_s, body.priority)
            for i, (ids, ticket) in enumerate(zip(prompts, tickets, strict=True))
        ]

        def release() -> None:
            for ticket in tickets:
                ticket.release()

        if body.stream:
            return EventStreamResponse(
                self._stream(body, request_id, params.n, streams, echoes, prompts), release
            )
        try:
            finals = await run_until_disconnect(raw, final_outputs(streams))
            if body.prompt_only:
                finals = [_without_completion(out) for out in finals]
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise as_openai_error(e, request_id) from e
        finally:
            release()
        return Response(
            self._response(body, request_id, params.n, finals, echoes).model_dump_json(),
            media_type="application/json",
        )

    def _logprobs(
        self,
        body: CompletionRequest,
        c: CompletionOutput,
        num_new: int,
        text_offset: int,
        echo_of: RequestOutput | None = None,
    ) -> CompletionLogprobs | None:
        """Logprobs of the sample's last `num_new` tokens, after its echoed prompt's when
        `echo_of` (the request's output) is given and the request asked for them."""
        generated = None
        if body.logprobs is not None and c.logprobs is not None:
            generated = completion_logprobs(
                c.logprobs[len(c.logprobs) - num_new :],
                body.logprobs,
                self.ctx.token_texts,
                text_offset,
                body.return_tokens_as_token_ids,
            )
        if echo_of is None or not body.echo_logprobs or echo_of.prompt_logprobs is None:
            return generated
        echoed = echo_logprobs(
            echo_of.prompt_token_ids,
            echo_of.prompt_logprobs,
            body.logprobs or 0,
            self.ctx.token_texts,
            body.return_tokens_as_token_ids,
        )
        return join_logprobs(echoed, generated)

    def _prompt_logprobs(
        self, body: CompletionRequest, out: RequestOutput
    ) -> PromptLogprobs | None:
        if body.prompt_logprobs is None:
            return None
        texts = self.ctx.token_texts
        return prompt_logprobs(out.prompt_logprobs, texts, body.return_tokens_as_token_ids)

    def _response(
        self,
        body: CompletionRequest,
        request_id: str,
        n: int,
        finals: list[RequestOutput],
        echoes: list[str],
    ) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i * n + c.index,
                text=echoes[i] + c.text,
                logprobs=self._logprobs(
                    body, c, len(c.token_ids), len(echoes[i]), final if body.echo else None
                ),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=self._prompt_logprobs(body, final),
            )
            for i, final in enumerate(finals)
            for c in final.outputs
        ]
        return CompletionResponse(
            id=request_id, model=self.ctx.model_name, choices=choices, usage=_usage(finals)
        )

    async def _stream(
        self,
        body: CompletionRequest,
        request_id: str,
        n: int,
        streams: list[AsyncGenerator[RequestOutput, None]],
        echoes: list[str],
        prompts: list[list[int]],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        exclude = None if body.include_usage else {"usage"}
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        num_sent_chars: dict[int, int] = {}
        finished: set[int] = set()
        echoed: set[int] = set()
        lasts: dict[int, RequestOutput] = {}
        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for i, out in merged:
                    if body.prompt_only:
                        out = _without_completion(out)
                    lasts[i] = out
                    for c in out.outputs:
                        index = i * n + c.index
                        if index in finished:
                            continue
                        if c.finish_reason is not None:
                            finished.add(index)
                        first = index not in echoed
                        offset = num_sent_chars.get(index, len(echoes[i]))
                        logprobs = self._logprobs(
                            body, c, len(c.delta_token_ids), offset, out if first else None
                        )
                        if logprobs is not None and not logprobs.tokens:
                            logprobs = None
                        if not c.delta_text and logprobs is None and c.finish_reason is None:
                            continue  # a token whose text is held back (maybe a stop string)
                        num_sent_chars[index] = offset + len(c.delta_text)
                        echoed.add(index)
                        choice = CompletionChoice(
                            index=index,
                            text=(echoes[i] if first else "") + c.delta_text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            prompt_logprobs=self._prompt_logprobs(body, out) if first else None,
                        )
                        payload = CompletionResponse(
                            id=request_id, created=created, model=self.ctx.model_name,
                            choices=[choice],
                        )  # fmt: skip
                        if body.continuous_usage:  # the usage so far, in every chunk
                            num_completion = sum(
                                len(c.token_ids) for o in lasts.values() for c in o.outputs
                            )
                            payload.usage = Usage.of(num_prompt_tokens, num_completion)
                        yield sse_event(payload, exclude)
            if body.include_usage and lasts:
                payload = CompletionResponse(
                    id=request_id, created=created, model=self.ctx.model_name, choices=[],
                    usage=_usage([lasts[i] for i in sorted(lasts)]),
                )  # fmt: skip
                yield sse_event(payload)
        except Exception as e:  # the client gets an error event, never a silent cut
            yield sse_error(e, request_id)
            return  # NOTE: no [DONE]: it would say the reply is whole
        yield DONE


async def final_outputs(
    streams: Sequence[AsyncGenerator[RequestOutput, None]],
) -> list[RequestOutput]:
    """Each stream's last output, in order, once every one finished."""
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merge_streams(list(streams))) as merged:
        async for i, out in merged:
            finals[i] = out
    if len(finals) != len(streams) or not all(out.finished for out in finals.values()):
        raise RuntimeError("the engine ended a request without a final output")
    return [finals[i] for i in range(len(streams))]


def _without_completion(out: RequestOutput) -> RequestOutput:
    """`out` with its samples' tokens left out (`max_tokens: 0`: the prompt is the reply), each
    finished for `length` once the engine finished it."""
    outputs = [
        dataclasses.replace(
            c,
            text="",
            token_ids=[],
            logprobs=[] if c.logprobs is not None else None,
            delta_text="",
            delta_token_ids=[],
            finish_reason="length" if c.finish_reason is not None else None,
            stop_reason=None,
        )
        for c in out.outputs
    ]
    return dataclasses.replace(out, outputs=outputs)


def _usage(finals: Sequence[RequestOutput]) -> Usage:
    return Usage.of(
        sum(len(out.prompt_token_ids) for out in finals),
        sum(len(c.token_ids) for out in finals for c in out.outputs),
        sum(out.num_cached_tokens for out in finals),
    )
