"""Tool-call parsers: a model's own tool-call format -> OpenAI `tool_calls` (docs/tool_calling.md).

Each family's format, as its chat template teaches it:

- `hermes` (Qwen2.5, Qwen3, Hermes; ChatML templates):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1-3.3): the reply is one JSON object `{"name": "f", "parameters":
  {...}}` (or several joined by `;`), optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]f[ARGS]{...}` per call.

A parser finds where the tool calls start in the text (`find_start`), how much of the text's
end may be the start of a marker and so must be held back while streaming (`held_back`), and
reads the calls out of the text from that start on (`complete_calls` while streaming, where
the format has an end marker; `final_calls` at the end).
"""

from __future__ import annotations

import json
import re
from typing import Any

ParsedCall = tuple[str, str]
"""(function name, arguments as JSON text)."""


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall:
    """(name, arguments text) of one decoded call object; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call object")
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        json.loads(args)  # the arguments must at least be JSON
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    """One model family's format. Stateless: the stream (router/tool_stream.py) keeps state."""

    name = ""
    end_marker: str | None = None
    """What ends each call, where the format has one: `complete_calls` finds nothing new
    until it appears (a stream looks for it in the new text only)."""
    needs_special_tokens = False
    """Its markers are special tokens, which the text keeps only with skip_special_tokens off."""

    def find_start(self, text: str, at_start: bool) -> int | None:
        """Where tool calls start in `text`, None when not (yet). `at_start`: no content was
        emitted before `text`."""
        raise NotImplementedError

    def held_back(self, text: str, at_start: bool) -> int:
        """How many characters at the end of `text` may begin a tool call (not yet content)."""
        raise NotImplementedError

    def complete_calls(self, text: str) -> tuple[list[ParsedCall], int]:
        """Calls already complete at the start of `text` (which starts where tool calls start)
        and how much text they took. Formats without an end marker wait for `final_calls`."""
        return [], 0

    def final_calls(self, text: str) -> list[ParsedCall] | None:
        """Every call in `text` at the end of the reply; None when it does not parse."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    end_marker = END

    def find_start(self, text: str, at_start: bool) -> int | None:
        i = text.find(self.START)
        return None if i < 0 else i

    def held_back(self, text: str, at_start: bool) -> int:
        return _marker_prefix_len(text, self.START)

    def complete_calls(self, text: str) -> tuple[list[ParsedCall], int]:
        calls: list[ParsedCall] = []
        used = 0
        while True:
            start = text.find(self.START, used)
            end = text.find(self.END, start + len(self.START)) if start >= 0 else -1
            if end < 0:
                return calls, used
            try:
                calls.append(_call(json.loads(text[start + len(self.START) : end])))
            except ValueError:
                return calls, used  # left for final_calls, which reports the failure
            used = end + len(self.END)

    def final_calls(self, text: str) -> list[ParsedCall] | None:
        calls, used = self.complete_calls(text)
        rest = text[used:]
        start = rest.find(self.START)
        if start >= 0:  # an unclosed last block (EOS instead of the end tag), or a bad one
            body = rest[start + len(self.START) :].removesuffix(self.END)
            end = body.find(self.END)
            try:
                calls.append(_call(json.loads(body if end < 0 else body[:end])))
            except ValueError:
                return None
        return calls or None


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def find_start(self, text: str, at_start: bool) -> int | None:
        if not at_start:
            return None
        stripped = text.lstrip()
        if stripped.startswith(("{", self.TAG)):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str, at_start: bool) -> int:
        if not at_start:
            return 0
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped):
            return len(text)
        return 0

    def final_calls(self, text: str) -> list[ParsedCall] | None:
        text = text.strip().removeprefix(self.TAG).strip()
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        i = 0
        try:
            while i < len(text):
                obj, i = decoder.raw_decode(text, i)
                calls.append(_call(obj, ("parameters", "arguments")))
                i = len(text) - len(text[i:].lstrip().removeprefix(";").lstrip())
        except ValueError:
            return None
        return calls or None


class MistralParser(ToolCallParser):
    name = "mistral"
    needs_special_tokens = True
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def find_start(self, text: str, at_start: bool) -> int | None:
        i = text.find(self.START)
        return None if i < 0 else i

    def held_back(self, text: str, at_start: bool) -> int:
        return _marker_prefix_len(text, self.START)

    def final_calls(self, text: str) -> list[ParsedCall] | None:
        body = text.strip().removeprefix(self.START).strip()
        try:
            if body.startswith("["):
                return [_call(obj) for obj in json.loads(body)] or None
            calls = []
            for part in body.split(self.START):  # name[ARGS]{...}, per call
                name, sep, args = part.partition(self.ARGS)
                if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name.strip()):
                    return None
                calls.append(_call({"name": name.strip(), "arguments": json.loads(args)}))
            return calls or None
        except (ValueError, TypeError):
            return None


PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def parser_for(name: str) -> ToolCallParser:
    """The parser called `name`; ValueError naming the known ones."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def infer_parser(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call markup (or its family) implies; `hermes`
    when nothing does (it only acts on `<tool_call>` blocks)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template or "[INST]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "hermes"
