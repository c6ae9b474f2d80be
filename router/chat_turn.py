"""One chat turn, free of any transport: a validated request in, its events out
(router/chat_events.py), its session turn committed once.

`ChatTurns` validates a chat request the same way for every transport (`plan`, then `open`:
the request's tools and sampling, the session's history, the chat template, the context's and
the KV pool's room, the priority, the caller's rate limit) and makes its `ChatTurn`. REST/SSE
(serving_chat.py), gRPC (grpc_server.py), the Batch API (batch_runner.py) and background
requests (background.py) admit it as they do and render what `ChatTurn.steps` yields.

A session turn is stored once every choice finished and before the events that say so go out,
so a client that saw a reply end knows it is stored; if storing fails, the error takes their
place. A background request that another replica takes over resumes from the steps it logged
(`TurnRequest.resume`): the reply's parser replays them and generation continues from the
prompt plus the tokens already out, with the remaining budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from duet.engine import InvalidInputError, RequestOutput, SamplingParams, TokenLogprobs
from duet.engine.tokenizer import IncrementalDetokenizer
from duet.router.admission import AdmissionTicket
from duet.router.chat_events import (
    ChatEvent,
    ChatStep,
    Final,
    Finish,
    PromptLogprobs,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
    Usage,
    logged_tokens,
)
from duet.router.errors import BadRequestError
from duet.router.openai_chat import ChatPlan, ReplyStream, reply_message
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.serving_context import ServingContext
from duet.router.sessions import SessionTurn
from duet.router.tool_stream import Piece, collect


@dataclass
class TurnRequest:
    """A validated chat request, ready to run."""

    request_id: str
    plan: ChatPlan
    params: SamplingParams
    """With the plan's grammar and special-token choice applied."""
    prompt_ids: list[int]
    max_tokens: int
    """The effective budget (`check_lengths`)."""
    priority: int = 0
    session: SessionTurn | None = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    """What the session turn stores before the reply: the request's own messages."""
    commit_once: bool = False
    """A request that may run again (background): a turn found stored already is kept."""
    resume: list[ChatStep] = field(default_factory=list)
    """Steps an earlier run of this request logged (one sample)."""


def chat_rename(body: ChatCompletionRequest) -> dict[str, str]:
    """Engine field names -> the chat request's, so a 400 names what the client sent."""
    return {"prompt": "messages", "max_tokens": body.max_tokens_field, "logprobs": "top_logprobs"}


class ChatTurns:
    """Makes chat turns over one `ServingContext`."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def plan(
        self, body: ChatCompletionRequest, rename: Mapping[str, str]
    ) -> tuple[ChatPlan, SamplingParams]:
        """The request's tools and sampling parameters (400s naming the client's fields)."""
        self.ctx.check_model(body.model)
        engine = self.ctx.engine
        try:
            params = body.to_sampling_params()
            if body.prediction is not None and engine.speculates_with_ngram:
                ids = engine.tokenizer.encode(body.prediction.text(), add_special_tokens=False)
                params = dataclasses.replace(params, prediction_token_ids=ids)
            return ChatPlan.of(body, self.ctx.chat_options, engine.tokenizer), params
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None

    async def open(
        self,
        body: ChatCompletionRequest,
        plan: ChatPlan,
        params: SamplingParams,
        api_key: str | None,
        request_id: str,
        rename: Mapping[str, str],
        live: bool = True,
    ) -> ChatTurn:
        """Read the session, render the prompt, check its room, the priority and (`live`:
        run here and now, not queued) the engine, and charge the caller's rate limit."""
        ctx = self.ctx
        new_messages = [m.to_template_message() for m in body.messages]
        session = None
        if body.session_id is not None:
            if params.n != 1:
                raise BadRequestError(
                    f"n: must be 1 with session_id (a session stores one reply per turn); "
                    f"got {params.n}",
                    param="n",
                )
            session = await ctx.sessions.begin_turn(body.session_id, api_key)
        messages = new_messages if session is None else [*session.history, *new_messages]
        try:
            prompt_ids = plan.render(ctx.engine.tokenizer, body, messages, ctx.engine.max_model_len)
            params = plan.sampling_params(params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None
        max_tokens = ctx.check_lengths(len(prompt_ids), params, rename)
        ctx.check_priority(body.priority)
        if live:
            ctx.check_engine()
        await ctx.rate_limiter.admit(api_key, len(prompt_ids) + max_tokens * params.n)
        request = TurnRequest(
            request_id, plan, params, prompt_ids, max_tokens, body.priority, session, new_messages
        )
        return ChatTurn(ctx, request)

    def rerun(
        self,
        body: ChatCompletionRequest,
        plan: ChatPlan,
        params: SamplingParams,
        messages: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        session: SessionTurn | None,
        request_id: str,
        engine_id: str,
        logged: list[ChatStep],
    ) -> ChatTurn:
        """A queued request, validated when it was submitted, run on this replica: from the
        start, or on from the steps an earlier run logged. Its tool calls are named by
        `request_id`, so every run (and the stored session turn) names them alike."""
        plan.tools.new_id = stable_call_ids(request_id, plan.parser.name == "mistral")
        try:
            prompt_ids = plan.render(
                self.ctx.engine.tokenizer, body, messages, self.ctx.engine.max_model_len
            )
            params = plan.sampling_params(params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, {}) from None
        max_tokens = self.ctx.check_lengths(len(prompt_ids), params, {})
        request = TurnRequest(
            engine_id, plan, params, prompt_ids, max_tokens, body.priority, session,
            new_messages, commit_once=True, resume=logged,
        )  # fmt: skip
        return ChatTurn(self.ctx, request)


def stable_call_ids(request_id: str, mistral: bool) -> Callable[[], str]:
    """Tool-call ids that are the same on every run of a request (Mistral's templates need 9
    letters or digits)."""
    counter = itertools.count()

    def new_id() -> str:
        digest = hashlib.sha256(f"{request_id}:{next(counter)}".encode()).hexdigest()
        return digest[:9] if mistral else f"call_{digest[:24]}"

    return new_id


class ChatTurn:
    """One validated chat request's run (see the module's docstring). `steps` once."""

    def __init__(self, ctx: ServingContext, request: TurnRequest) -> None:
        self.ctx = ctx
        self.request = request
        n = request.params.n
        self._replies: list[ReplyStream] = [request.plan.new_reply() for _ in range(n)]
        self._pieces: list[list[Piece]] = [[] for _ in range(n)]
        self._finished: dict[int, Finish] = {}
        self._logged_logprobs: dict[int, list[TokenLogprobs]] = {}
        self._prompt_sent = False

    @property
    def n(self) -> int:
        return self.request.params.n

    @property
    def will_generate(self) -> bool:
        """False when the steps it resumes from already hold the whole reply."""
        emitted, _, finish = logged_tokens(self.request.resume)
        return finish is None and len(emitted) < self.request.max_tokens

    async def steps(
        self, ticket: AdmissionTicket | None, arrival_s: float
    ) -> AsyncGenerator[ChatStep, None]:
        """Run the turn under `ticket` (released however it ends; None only when it will not
        generate): its events, one engine step at a time, then `Usage` and `Final`. Leaving
        early aborts the engine request."""
        r = self.request
        emitted, text, finish = logged_tokens(r.resume)
        self._replay(r.resume)
        last: RequestOutput | None = None
        if not self.will_generate and ticket is not None:
            ticket.release()
        if finish is None:
            remaining = r.max_tokens - len(emitted)
            if remaining <= 0:  # the log holds the whole budget: only the end is missing
                step = ChatStep(self._close(0, "length", None))
                await self._commit()
                yield step
            else:
                assert ticket is not None, "a turn that generates runs under a ticket"
                generated = self._generate(emitted, text, remaining, ticket, arrival_s)
                async with aclosing(generated):  # leaving early aborts the engine request now
                    async for step, out in generated:
                        last = out
                        yield step
        else:
            await self._commit()
        completion = sum(len(c.token_ids) for c in last.outputs) if last else 0
        cached = last.num_cached_tokens if last and not emitted else 0
        usage = Usage(len(r.prompt_ids), len(emitted) + completion, cached)
        prompt_logprobs = (
            last.prompt_logprobs if last and r.params.prompt_logprobs is not None else None
        )
        yield ChatStep([usage, Final(self._final(last), usage, prompt_logprobs)])

    async def _generate(
        self,
        emitted: list[int],
        logged_text: str,
        remaining: int,
        ticket: AdmissionTicket,
        arrival_s: float,
    ) -> AsyncGenerator[tuple[ChatStep, RequestOutput], None]:
        r = self.request
        params, detok = r.params, None
        if emitted:  # a takeover: continue the text exactly where the log ends
            params = dataclasses.replace(
                params, max_tokens=remaining, min_tokens=max(0, params.min_tokens - len(emitted))
            )
            # NOTE: the engine's own text deltas would restart at the continuation's prompt
            # and drop a character split across the takeover.
            detok = IncrementalDetokenizer(
                self.ctx.engine.tokenizer, r.prompt_ids, params.skip_special_tokens
            )
            for token_id in emitted:
                detok.add_token(token_id)
            detok.text = detok.text[len(logged_text) :]  # what the log lacks: a held tail
        outputs = self.ctx.generate(
            r.prompt_ids + emitted, params, r.request_id, ticket, arrival_s, r.priority
        )
        num_logprobs: dict[int, int] = {}
        async with aclosing(outputs):
            async for out in outputs:
                step = ChatStep()
                if params.prompt_logprobs is not None and not self._prompt_sent:
                    step.events.append(PromptLogprobs(out.prompt_logprobs))  # the first output's
                    self._prompt_sent = True
                for c in out.outputs:
                    if c.index in self._finished or (not c.delta_token_ids and not c.finished):
                        continue
                    text = c.delta_text
                    if detok is not None:
                        pending, detok.text = detok.text, ""
                        text = pending + "".join(detok.add_token(t) for t in c.delta_token_ids)
                        detok.text = ""
                    logprobs = None
                    if c.logprobs is not None:
                        logprobs = c.logprobs[num_logprobs.get(c.index, 0) :]
                        num_logprobs[c.index] = len(c.logprobs)
                    step.events.append(TokenDelta(c.index, list(c.delta_token_ids), text, logprobs))
                    step.events += self._parsed(c.index, text)
                    if c.finish_reason is not None:
                        step.events += self._close(c.index, c.finish_reason, c.stop_reason)
                if out.finished:
                    await self._commit()  # before the events that say the reply ended
                yield step, out

    def _parsed(self, index: int, text: str) -> list[ChatEvent]:
        piece = self._replies[index].feed(text)
        self._pieces[index].append(piece)
        return _piece_events(index, piece)

    def _close(self, index: int, reason: str, stop_reason: int | str | None) -> list[ChatEvent]:
        """Choice `index` ended: what its parser still held, then its `Finish`."""
        reply = self._replies[index]
        piece = reply.finish()
        self._pieces[index].append(piece)
        finish = Finish(index, reply.finish_reason(reason) or reason, stop_reason)
        self._finished[index] = finish
        return [*_piece_events(index, piece), finish]

    def _replay(self, steps: list[ChatStep]) -> None:
        """A takeover: the logged text through the reply's parser, as it went the first time
        (its tool calls get the same ids: background requests name them by request id)."""
        for step in steps:
            for event in step.events:
                if isinstance(event, TokenDelta):
                    self._pieces[event.index].append(self._replies[event.index].feed(event.text))
                    if event.logprobs:  # the reply's logprobs start with the logged tokens'
                        self._logged_logprobs.setdefault(event.index, []).extend(event.logprobs)
                elif isinstance(event, Finish):
                    self._pieces[event.index].append(self._replies[event.index].finish())
                    self._finished[event.index] = event

    async def _commit(self) -> None:
        r = self.request
        if r.session is None:
            return
        reply = reply_message(self._pieces[0])
        if r.commit_once:
            await self.ctx.sessions.commit_turn_once(r.session, r.new_messages, reply)
        else:
            await self.ctx.sessions.commit_turn(r.session, r.new_messages, reply)

    def _final(self, last: RequestOutput | None) -> list[Reply]:
        replies = []
        for index, pieces in enumerate(self._pieces):
            content, calls = collect(pieces)
            reasoning = "".join(p.reasoning for p in pieces)
            if reasoning and not content:
                content = None  # only thinking: no answer yet
            finish = self._finished.get(index) or Finish(index, "abort")
            sample = last.outputs[index] if last is not None else None
            logprobs = sample.logprobs if sample is not None else None
            logged = self._logged_logprobs.get(index)
            if logged:
                logprobs = logged + (logprobs or [])
            replies.append(
                Reply(
                    index, content, reasoning or None, calls, finish.reason, finish.stop_reason,
                    logprobs,
                )
            )  # fmt: skip
        return replies


def _piece_events(index: int, piece: Piece) -> list[ChatEvent]:
    events: list[ChatEvent] = []
    if piece.reasoning:
        events.append(ReasoningDelta(index, piece.reasoning))
    if piece.content:
        events.append(TextDelta(index, piece.content))
    events += [ToolCallDelta(index, call) for call in piece.tool_calls]
    return events


async def final_of(steps: AsyncGenerator[ChatStep, None]) -> Final:
    """Run a turn to its end (for a renderer that shows only the whole reply)."""
    final = None
    async with aclosing(steps):
        async for step in steps:
            final = step.first(Final) or final
    if final is None:
        raise RuntimeError("the chat turn ended without its final event")
    return final
