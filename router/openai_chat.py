"""What a chat request asks beyond sampling: its tools and their grammar, its chat-template
options, and how its reply text becomes content, reasoning and tool calls
(docs/tool_calling.md).

`ChatOptions` is the server's side (`--tool-call-parser`, `--reasoning-parser`); `ChatPlan`
is one request's, made once in the router before anything is queued, so every mistake is a
400 naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from duet.engine import InvalidInputError, SamplingParams
from duet.engine.request_checks import check_prompt_chars
from duet.engine.tokenizer import Message, Tokenizer
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_tools import ToolCall, ToolPlan, mistral_call_id, openai_call_id, plan_tools
from duet.router.reasoning_parsers import PARSERS as REASONING_PARSERS
from duet.router.reasoning_parsers import ReasoningStream, ReplyStart, reply_start
from duet.router.tool_parsers import ToolCallParser, infer_parser, parser_for
from duet.router.tool_stream import Piece, ToolCallStream, collect, stream_for

# Template variables a request sets through its own fields, never through chat_template_kwargs.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "chat_template"}
)


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat options."""

    tool_call_parser: str | None = None
    """How `tool_choice: "auto"` replies are parsed (hermes, llama3_json, mistral); None:
    inferred from the chat template."""
    reasoning_parser: str | None = None
    """Where a reply's thinking goes (qwen3, deepseek_r1): `reasoning_content`. None: the
    thinking stays in `content`."""
    trust_request_chat_template: bool = False
    """Render a `chat_template` a request brings (`--trust-request-chat-template`). Off, such
    a request is a 400 naming `chat_template`: a template runs on the server, and one line of
    it can take unbounded time or memory (`{{ 'x' * 10**10 }}`, nested loops) while the
    request holds the event loop (as vLLM's `--trust-request-chat-template`)."""

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            try:
                parser_for(self.tool_call_parser)
            except ValueError as e:
                raise ValueError(f"tool_call_parser: {e}") from None
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser: unknown {self.reasoning_parser!r}; known: "
                f"{', '.join(REASONING_PARSERS)}"
            )

    def parser(self, tokenizer: Tokenizer, chat_template: str | None) -> ToolCallParser:
        return parser_for(
            self.tool_call_parser or infer_parser(chat_template or tokenizer.chat_template)
        )


UNTRUSTED_CHAT_TEMPLATE = (
    "this server does not render chat templates sent with a request (one can take unbounded "
    "time and memory); leave it out to use the model's, or start the server with "
    "--trust-request-chat-template"
)


@dataclass
class ChatPlan:
    """One chat request's tools, template variables and parser."""

    tools: ToolPlan
    parser: ToolCallParser
    reasoning_parser: str | None = None
    reply_start: ReplyStart | None = None
    """How the reply starts (thinking or not), once the prompt is rendered (`render`)."""

    @classmethod
    def of(
        cls, body: ChatCompletionRequest, options: ChatOptions, tokenizer: Tokenizer
    ) -> ChatPlan:
        """`InvalidInputError` naming the request's field for a chat template the server
        does not take, a choice that names no tool, a tool schema that does not compile, or a
        forbidden combination."""
        if body.chat_template is not None and not options.trust_request_chat_template:
            raise InvalidInputError("chat_template", UNTRUSTED_CHAT_TEMPLATE)
        parser = options.parser(tokenizer, body.chat_template)
        new_id = mistral_call_id if parser.name == "mistral" else openai_call_id
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, new_id)
        if tools.mode in ("required", "named"):
            fmt = body.response_format
            if fmt is not None and fmt.type != "text":
                raise InvalidInputError(
                    "response_format", f"cannot be combined with a {tools.mode} tool_choice"
                )
            if body.structured_outputs is not None:
                raise InvalidInputError(
                    "structured_outputs", f"cannot be combined with a {tools.mode} tool_choice"
                )
        if body.background:
            if body.priority != 0:
                raise InvalidInputError("priority", "cannot be combined with background (not yet)")
            for field in ("chat_template", "chat_template_kwargs"):
                if getattr(body, field) is not None:
                    raise InvalidInputError(field, "cannot be combined with background (not yet)")
            if body.continue_final_message or not body.add_generation_prompt:
                raise InvalidInputError(
                    "background", "needs the default add_generation_prompt (not yet)"
                )
        return cls(tools, parser, options.reasoning_parser)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tools' grammar, and special tokens kept where the parser needs
        them."""
        constraint = self.tools.constraint()
        if constraint is not None and params.structured_outputs is not None:
            raise InvalidInputError(
                "structured_outputs", f"cannot be combined with a {self.tools.mode} tool_choice"
            )
        constraint = constraint or params.structured_outputs
        if constraint is not None and self.reply_start is not None:
            constraint = dataclasses.replace(constraint, reasoning=self.reply_start)
        if constraint is not None:
            params = dataclasses.replace(params, structured_outputs=constraint)
        if self.tools.mode == "auto" and self.parser.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def new_reply(self) -> ReplyStream:
        """A fresh per-choice reply stream."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = ReasoningStream(self.reply_start)
        return ReplyStream(stream_for(self.tools, self.parser), reasoning, self.tools.mode)

    def render(
        self,
        tokenizer: Tokenizer,
        body: ChatCompletionRequest,
        messages: list[Message],
        max_model_len: int | None = None,
    ) -> list[int]:
        """The prompt's token ids (`render_chat`); notes whether the reply starts thinking.
        A template that fails is `InvalidInputError` naming messages, chat_template or
        chat_template_kwargs; so is a rendered prompt provably longer than `max_model_len`
        tokens, refused before it is tokenized, unless the request truncates it
        (`truncate_prompt_tokens`: its last tokens, given `max_model_len`; the body's size
        bound still holds)."""
        try:
            text = render_chat(tokenizer, body, messages, self)
        except jinja2.TemplateError as e:
            field = "messages" if body.chat_template is None else "chat_template"
            raise InvalidInputError(field, f"the chat template failed: {e}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:
            # A template or variables the request brought may fail in any way while rendering.
            if isinstance(e, InvalidInputError) or (
                body.chat_template is None and body.chat_template_kwargs is None
            ):
                raise
            field = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
            raise InvalidInputError(field, f"the chat template failed: {e!r}") from None
        if self.reasoning_parser is not None:
            self.reply_start = reply_start(self.reasoning_parser, text)
        if max_model_len is None:
            return tokenizer.encode(text, add_special_tokens=False)
        if body.truncate_prompt_tokens is None:
            check_prompt_chars(tokenizer, text, max_model_len, "messages")
        # The template already holds BOS where the model wants one.
        return body.truncated(tokenizer.encode(text, add_special_tokens=False), max_model_len)


class ReplyStream:
    """One choice's text -> reasoning, content and tool-call pieces, as it streams in."""

    def __init__(
        self, tools: ToolCallStream | None, reasoning: ReasoningStream | None, mode: str
    ) -> None:
        self._tools = tools
        self._reasoning = reasoning
        self._mode = mode

    def feed(self, text: str) -> Piece:
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
        piece = self._tools.feed(text) if self._tools is not None else Piece(content=text)
        piece.reasoning = reasoning
        return piece

    def finish(self) -> Piece:
        reasoning, text = self._reasoning.finish() if self._reasoning is not None else ("", "")
        piece = self.feed_tail(text)
        piece.reasoning = reasoning
        return piece

    def feed_tail(self, text: str) -> Piece:
        if self._tools is None:
            return Piece(content=text)
        return self._tools.feed(text).then(self._tools.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: `tool_calls` when the model chose to call tools (not for a named
        function, which OpenAI reports as `stop`)."""
        called = self._tools is not None and self._tools.num_calls > 0
        if reason == "stop" and called and self._mode != "named":
            return "tool_calls"
        return reason

    def whole(self, text: str) -> tuple[Piece, str | None, list[ToolCall]]:
        """A whole reply: (all pieces merged, content, tool calls). Content is None when the
        reply is only tool calls, or only thinking (cut by max_tokens: no answer yet)."""
        first = self.feed(text)
        last = self.finish()
        content, calls = collect([first, last])
        piece = first.then(last)
        if piece.reasoning and not content:
            content = None
        return piece, content, calls


def render_chat(
    tokenizer: Tokenizer, body: ChatCompletionRequest, messages: list[Message], plan: ChatPlan
) -> str:
    """The prompt: the chat template (the request's own, or the model's) over `messages`,
    with the tools and `chat_template_kwargs` as template variables."""
    variables: dict[str, Any] = dict(body.chat_template_kwargs or {})
    for key in variables:
        if key in _RESERVED_TEMPLATE_VARIABLES:
            raise InvalidInputError(
                f"chat_template_kwargs.{key}", "is set by the request's own fields"
            )
    if body.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    tools = plan.tools.template_tools()
    if tools is not None:
        variables["tools"] = tools
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=body.add_generation_prompt,
        chat_template=body.chat_template,
        continue_final_message=body.continue_final_message,
        **variables,
    )


def template_reads(tokenizer: Tokenizer, variable: str, chat_template: str | None = None) -> bool:
    """Whether the chat template (the request's own, or the model's) reads `variable` (e.g.
    `reasoning_effort`), so a request's value for it changes the prompt."""
    source = chat_template or tokenizer.chat_template
    if not source:
        return False
    try:
        parsed = jinja2.Environment().parse(source)
    except jinja2.TemplateError:
        return False
    return variable in jinja2.meta.find_undeclared_variables(parsed)


def assistant_message(
    content: str | None, tool_calls: list[ToolCall] | None, reasoning: str | None = None
) -> dict[str, Any]:
    """A reply as a session stores it, the way a client sends it back: its content, its tool
    calls under the ids the client got (so the next turn's `tool` messages match them) and its
    thinking apart, in the chat templates' shape (`ChatMessage.to_template_message`)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if tool_calls:
        message["tool_calls"] = [call.to_template() for call in tool_calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def reply_message(pieces: list[Piece]) -> dict[str, Any]:
    """`assistant_message` of a streamed reply's pieces."""
    content, calls = collect(pieces)
    return assistant_message(content, calls, "".join(p.reasoning for p in pieces))
