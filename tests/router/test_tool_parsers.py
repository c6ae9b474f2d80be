"""Tool-call and reasoning parsers on fixed texts, fed whole and in pieces of every size: the
streamed deltas, merged, equal the whole reply."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from duet.router.openai_chat import ChatOptions
from duet.router.reasoning_parsers import ReasoningStream, reply_start
from duet.router.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallParser,
    infer_parser,
)
from duet.router.tool_stream import ParsedCallsStream as Parsed
from duet.router.tool_stream import (
    Piece,
    RequiredCallsStream,
    ToolCallStream,
    collect,
)

Calls = list[tuple[str, str]]


Make = Callable[[Callable[[], str]], ToolCallStream]


def _run(make: Make, text: str, step: int) -> tuple[str | None, Calls]:
    counter = itertools.count()
    stream = make(lambda: f"id{next(counter)}")
    pieces = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    pieces.append(stream.finish())
    content, calls = collect(pieces)
    assert [c.id for c in calls] == [f"id{i}" for i in range(len(calls))]
    return content, [(c.function.name, c.function.arguments) for c in calls]


def _every_step(make: Make, text: str) -> tuple[str | None, Calls]:
    results = {step: _run(make, text, step) for step in (1, 2, 3, 7, len(text) or 1)}
    assert len(set(map(repr, results.values()))) == 1, results
    return results[1]


def test_the_required_grammars_array_streams_arguments_as_they_come() -> None:
    text = (
        '[{"name": "f", "parameters": {"s": "a\\"}b", "n": [1, {"x": 2}]}}, '
        '{"name": "g", "parameters": {}}]'
    )
    assert _every_step(RequiredCallsStream, text) == (
        None,
        [("f", '{"s": "a\\"}b", "n": [1, {"x": 2}]}'), ("g", "{}")],
    )
    # Streamed: the first call's header before its arguments are complete.
    stream = RequiredCallsStream(lambda: "id")
    piece = stream.feed('[{"name": "f", "parameters": {"s": "ab')
    assert [(d.index, d.id, d.function and d.function.arguments) for d in piece.tool_calls] == [
        (0, "id", ""),
        (0, None, '{"s": "ab'),
    ]


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        (HermesParser(),
         'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
         ("Let me see.\n", [("f", '{"a": 1}'), ("g", "{}")])),
        (HermesParser(), '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
         (None, [("f", '{"a": 1}')])),  # EOS before the end tag
        (HermesParser(), "a < b <tool_ca", ("a < b <tool_ca", [])),
        (HermesParser(), "<tool_call>not json</tool_call>",
         ("<tool_call>not json</tool_call>", [])),  # nothing parsed: it was content
        (Llama3JsonParser(), ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
         (None, [("f", '{"a": 1}'), ("g", "{}")])),
        (Llama3JsonParser(), 'hello {"name": "f"}', ('hello {"name": "f"}', [])),
        (Llama3JsonParser(), '<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 2}"}',
         (None, [("f", '{"a": 2}')])),
        (MistralParser(), 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
         ("ok ", [("f", '{"a": 1}')])),
        (MistralParser(), '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}',
         (None, [("f", '{"a": 1}'), ("g", "{}")])),
        (MistralParser(), "[TOOL_CALLS]oops", ("[TOOL_CALLS]oops", [])),
    ],
)  # fmt: skip
def test_auto_parsers_read_their_familys_format(
    parser: ToolCallParser, text: str, expected: tuple[str | None, Calls]
) -> None:
    assert _every_step(lambda new_id: Parsed(parser, True, new_id), text) == expected


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    make = lambda new_id: Parsed(HermesParser(), False, new_id)  # noqa: E731
    assert _every_step(make, text) == (None, [("f", "{}")])


def test_content_streams_before_a_marker_is_complete() -> None:
    stream = Parsed(HermesParser(), True, lambda: "id")
    assert stream.feed("Hello <tool") == Piece(content="Hello ")
    assert stream.feed("box>") == Piece(content="<toolbox>")


def test_the_default_parser_comes_from_the_chat_template() -> None:
    assert infer_parser("{{ '[INST]' }} ... [TOOL_CALLS]") == "mistral"
    assert infer_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert infer_parser("<|im_start|>{{ m.role }}<tool_call>") == "hermes"
    assert infer_parser(None) == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser: unknown tool-call parser 'x'"):
        ChatOptions(tool_call_parser="x")
    with pytest.raises(ValueError, match="reasoning_parser: unknown 'r1'"):
        ChatOptions(reasoning_parser="r1")
    from duet.router.server import RouterConfig

    with pytest.raises(ValueError, match=r"^--tool-call-parser: unknown tool-call parser 'x'"):
        RouterConfig(tool_call_parser="x")
    assert RouterConfig(reasoning_parser="qwen3").chat_options == ChatOptions(None, "qwen3")


def _split(start: str | None, text: str, step: int) -> tuple[str, str]:
    stream = ReasoningStream(start)  # type: ignore[arg-type]
    parts = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    parts.append(stream.finish())
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(
    "start, text, expected",
    [
        ("may_think", "<think>\nhmm</think>\n\nAnswer.", ("\nhmm", "Answer.")),
        ("may_think", "Answer <think>", ("", "Answer <think>")),
        ("may_think", "<thin", ("", "<thin")),
        ("thinking", "hmm, so</think>\n\n{}", ("hmm, so", "{}")),
        ("thinking", "still thinking </thi", ("still thinking </thi", "")),
        ("thinking", "<think>x</think>y", ("x", "y")),
        (None, "<think>x</think>y", ("", "<think>x</think>y")),
    ],
)
def test_reasoning_is_split_off_at_every_step(
    start: str | None, text: str, expected: tuple[str, str]
) -> None:
    for step in (1, 2, 5, len(text)):
        assert _split(start, text, step) == expected, step


def test_how_a_reply_starts_follows_the_prompt() -> None:
    assert reply_start("qwen3", "<|im_start|>assistant\n") == "may_think"
    assert reply_start("qwen3", "<|im_start|>assistant\n<think>\n") == "thinking"
    assert reply_start("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert reply_start("deepseek_r1", "<｜Assistant｜>") == "thinking"
    assert reply_start("deepseek_r1", "<｜Assistant｜><think>\n") == "thinking"


class _CountingHermes(HermesParser):
    """Counts the characters handed to the parser: the work a stream makes it do."""

    def __init__(self) -> None:
        self.num_chars = 0

    def find_start(self, text: str, at_start: bool) -> int | None:
        self.num_chars += len(text)
        return super().find_start(text, at_start)

    def held_back(self, text: str, at_start: bool) -> int:
        self.num_chars += len(text)
        return super().held_back(text, at_start)

    def complete_calls(self, text: str) -> tuple[list[tuple[str, str]], int]:
        self.num_chars += len(text)
        return super().complete_calls(text)

    def final_calls(self, text: str) -> list[tuple[str, str]] | None:
        self.num_chars += len(text)
        return super().final_calls(text)


def test_a_long_call_in_one_character_deltas_is_parsed_in_linear_work() -> None:
    arguments = '{"s": "' + 'x\\"y</' * 3400 + '", "n": 1}'  # 20k characters
    text = f'Sure.<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    whole = _run(lambda new_id: Parsed(HermesParser(), True, new_id), text, len(text))
    assert whole == ("Sure.", [("f", arguments.replace('\\"', '\\"'))])
    parser = _CountingHermes()
    stream = Parsed(parser, True, lambda: "id0")
    pieces = [stream.feed(ch) for ch in text]
    pieces.append(stream.finish())
    content, calls = collect(pieces)
    assert (content, [(c.function.name, c.function.arguments) for c in calls]) == whole
    assert pieces[-2].tool_calls and not pieces[-3].tool_calls  # out once its end tag is in
    # Each character is looked at a bounded number of times: within one end marker's length
    # of the new text, then parsed once or twice (before: the whole text at every delta,
    # 7,500 times its length for a 15k-character call).
    bound = (len(HermesParser.END) + 4) * len(text)
    assert parser.num_chars + stream.num_scanned_chars <= bound
