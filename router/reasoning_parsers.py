"""Reasoning parsers: a reply's `<think>...</think>` -> `reasoning_content`, the rest ->
`content` (docs/tool_calling.md).

- `qwen3`: the reply thinks when it starts with `<think>`, or when the prompt already opened
  a think block (newer Qwen3 templates do); with `enable_thinking: false` it does not.
- `deepseek_r1`: the reply is thinking until `</think>` (its template opens `<think>` in the
  prompt); a leading `<think>` is dropped.
"""

from __future__ import annotations

from typing import Literal

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")

ReplyStart = Literal["thinking", "may_think"]
"""How a reply starts: inside thinking, or with an optional `<think>...</think>` block."""


def reply_start(parser: str, prompt_text: str) -> ReplyStart | None:
    """How a reply to `prompt_text` starts; None: it does not think (the prompt closed its
    think block, as Qwen3's template does with enable_thinking false)."""
    if prompt_text.rstrip().endswith(THINK_END):
        return None
    if parser == "deepseek_r1" or prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END):
        return "thinking"
    return "may_think"


def _prefix_len(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Splits one reply's text, as it streams in, into (reasoning, content)."""

    def __init__(self, start: ReplyStart | None) -> None:
        self._state = "content" if start is None else "start"
        self._thinking_by_default = start == "thinking"
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning = content = ""
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                    break  # maybe the start of <think>: wait
                if stripped.startswith(THINK_START):
                    self._pending = stripped[len(THINK_START) :]
                    self._state = "thinking"
                else:
                    self._state = "thinking" if self._thinking_by_default else "content"
            elif self._state == "thinking":
                end = self._pending.find(THINK_END)
                if end < 0:
                    keep = _prefix_len(self._pending, THINK_END)
                    reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                reasoning += self._pending[:end]
                self._pending = self._pending[end + len(THINK_END) :]
                self._state = "after"
            elif self._state == "after":  # the blank lines a model puts after </think>
                self._pending = self._pending.lstrip("\n")
                if self._pending:
                    self._state = "content"
            else:
                content += self._pending
                self._pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply."""
        rest, self._pending = self._pending, ""
        if self._state == "thinking" or (self._state == "start" and self._thinking_by_default):
            return rest, ""
        return "", rest if self._state != "after" else ""
