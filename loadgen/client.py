"""One streamed request through the OpenAI-compatible REST API, timed at the client.

`/v1/completions` (prompt as token ids or text) or `/v1/chat/completions`, `stream=true` with
`stream_options.include_usage`, so the last event carries the exact token counts: one event may
carry several tokens (the server holds back text that could be the start of a stop string or
half a UTF-8 character), so counting events would undercount.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2


class SSEDecoder:
    """Server-sent events from a byte stream: lines end in \\n, \\r\\n or \\r; an event is its
    `data:` lines joined by \\n and ends at a blank line; comments (`:`) and other fields are
    skipped. Feed chunks split anywhere; complete events come out in order."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""  # the incomplete line so far
        self._data: list[str] = []
        self._after_cr = False  # a \\n right after \\r ends no second line

    def feed(self, chunk: bytes) -> Iterator[str]:
        text = self._decoder.decode(chunk)
        start = 0
        for i, ch in enumerate(text):
            if ch not in "\r\n":
                continue
            if ch == "\n" and self._after_cr and i == start:
                self._after_cr = False
                start = i + 1
                continue
            self._line += text[start:i]
            start = i + 1
            self._after_cr = ch == "\r"
            event = self._end_line()
            if event is not None:
                yield event
        if start < len(text):
            self._after_cr = False
            self._line += text[start:]

    def _end_line(self) -> str | None:
        line, self._line = self._line, ""
        if line == "":
            event = "\n".join(self._data) if self._data else None
            self._data = []
            return event
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds; `send_s` is from the run start."""

    index: int
    input_len: int  # tokens the workload asked for
    output_len: int  # max_tokens
    send_s: float = 0.0
    ttft_s: float | None = None  # send -> first event with output
    e2e_s: float | None = None  # send -> end of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between events with output
    prompt_tokens: int | None = None  # from usage
    output_tokens: int = 0  # from usage (else the number of events with output)
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "input_len": self.input_len, "output_len": self.output_len,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "send_s": self.send_s, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s, "itl_s": self.itl_s, "error": self.error,
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        return cls(
            d["index"], d["input_len"], d["output_len"], d["send_s"], d["ttft_s"], d["e2e_s"],
            list(d["itl_s"]), d["prompt_tokens"], d["output_tokens"], d["error"],
        )  # fmt: skip


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: `kind` is "completions" or "chat"."""

    url: str  # server root, e.g. http://127.0.0.1:8000
    kind: str
    model: str
    api_key: str | None = None
    temperature: float = 0.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # duet/vLLM extension: output lengths exactly max_tokens
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


def _carries_tokens(event: dict[str, Any], kind: str) -> bool:
    """Whether an event holds new output: text, or the finish (whose tokens' text may all have
    been held back). Chat's first event, the assistant role with no content, holds none."""
    for choice in event.get("choices") or []:
        if choice.get("finish_reason") is not None:
            return True
        if kind == "chat" and (choice.get("delta") or {}).get("content"):
            return True
        if kind != "chat" and choice.get("text"):
            return True
    return False


async def send_request(
    client: httpx2.AsyncClient,
    endpoint: Endpoint,
    prompt: list[int] | str,
    result: RequestResult,
    run_start: float,
    timeout_s: float,
) -> RequestResult:
    """Stream one request, filling `result`. Never raises for a failed request: the error
    goes into `result.error`. The whole request is bounded by `timeout_s`."""
    start = time.perf_counter()
    result.send_s = start - run_start
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, endpoint, prompt, result, start)
    except TimeoutError:
        result.error = f"timed out after {timeout_s:g}s (--request-timeout-s)"
    except httpx2.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not OpenAI's shape
        result.error = f"malformed event: {type(e).__name__}: {e}"
    return result


async def _stream(
    client: httpx2.AsyncClient,
    endpoint: Endpoint,
    prompt: list[int] | str,
    result: RequestResult,
    start: float,
) -> None:
    body = endpoint.body(prompt, result.output_len)
    url = endpoint.url.rstrip("/") + endpoint.path
    async with client.stream("POST", url, json=body, headers=endpoint.headers) as response:
        if response.status_code != 200:
            raw = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {_error_message(raw)}"
            return
        decoder = SSEDecoder()
        last_token_s: float | None = None
        num_token_events = 0
        done = False
        async for chunk in response.aiter_bytes():
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                if data.strip() == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {_error_message(data)}"
                    return
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens") or 0
                if _carries_tokens(event, endpoint.kind):
                    num_token_events += 1
                    if last_token_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last_token_s)
                    last_token_s = now
        result.e2e_s = time.perf_counter() - start
        if not done:
            result.error = "the stream ended without data: [DONE]"
        elif result.ttft_s is None:
            result.error = "the stream carried no output"
        elif result.prompt_tokens is None:  # a server without include_usage: count events
            result.output_tokens = num_token_events


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return raw.strip()[:300]
