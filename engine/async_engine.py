"""`AsyncEngine`: an `LLMEngine` driven by its own thread, for servers.

`generate()` is an async iterator of incremental `RequestOutput`s; leaving it early (client
gone, task cancelled) aborts the request and frees its blocks. Only the engine thread touches
the `LLMEngine`; other threads talk to it through a command queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import InvalidInputError
from engine.llm_engine import EngineStats, LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Message, Tokenizer

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped; in-flight and new requests fail (retryable elsewhere)."""


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[Any] = queue.Queue()  # _Add, _Abort, a subclass's, None: stop
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="duet-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig | None = None, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine(config or EngineConfig.from_kwargs(**kwargs)))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # What the servers read of the engine (router.engine_client.EngineClient).

    @property
    def is_ready(self) -> bool:
        return self.is_running

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.max_num_seqs

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.engine.encode_chat(messages)

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.engine.check_lengths(num_prompt_tokens, params)

    async def start(self) -> None:
        """Nothing to start: the engine thread runs from construction."""

    async def stop(self) -> None:
        """Nothing to stop: whoever built the engine shuts it down."""

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Bad input raises `InvalidInputError` before anything
        is queued."""
        if self._dead is not None:
            raise EngineDeadError("engine is not running") from self._dead
        params = params or SamplingParams()
        _, ids = self.engine.tokenize_prompt(prompt)
        self.engine.check_lengths(len(ids), params)
        request_id, out_queue = self._open_stream(request_id)
        self._commands.put(_Add(request_id, prompt, params, priority))
        # aclosing: leaving this generator must run _iterate's abort at once, not at GC time.
        async with aclosing(self._iterate(request_id, out_queue)) as outputs:
            async for out in outputs:
                yield out

    def _open_stream(self, request_id: str | None) -> tuple[str, asyncio.Queue[Any]]:
        """Register a stream for a request about to be queued (a fresh id when None)."""
        with self._lock:
            # Checked under the lock: the loop marks itself dead under it before it notifies
            # the registered streams, so a stream is either notified or refused here.
            if self._dead is not None:
                raise EngineDeadError("engine is not running") from self._dead
            if request_id is None:
                self._counter += 1
                request_id = f"req-{self._counter}"
            if request_id in self._streams:
                raise InvalidInputError("request_id", f"{request_id!r} is already running")
            out_queue: asyncio.Queue[Any] = asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), out_queue)
        return request_id, out_queue

    async def _iterate(
        self, request_id: str, out_queue: asyncio.Queue[Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; exceptions published for it are
        raised. Leaving early aborts the request."""
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._close_stream(request_id, finished)

    def _close_stream(self, request_id: str, finished: bool) -> None:
        """Unregister a request's stream; abort the request unless it finished. Idempotent."""
        with self._lock:
            registered = self._streams.pop(request_id, None) is not None
        if registered and not finished:
            self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; in-flight streams end with `EngineDeadError`."""
        self._commands.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        try:
            while True:
                if not self._drain(self._wait_s()):
                    break
                for request_id, item in self._poll():
                    self._publish(request_id, item)
                for out in self.engine.step():
                    self._publish(out.request_id, out)
        except BaseException as e:  # any failure must reach every waiting client
            logger.exception("engine loop failed")
            with self._lock:
                self._dead = e
        finally:
            with self._lock:
                if self._dead is None:
                    self._dead = EngineDeadError("engine shut down")
                streams = list(self._streams)
            for request_id in streams:
                self._publish(request_id, EngineDeadError(str(self._dead)))
            self._on_exit()

    def _wait_s(self) -> float:
        """How long the loop may wait for a command before stepping again."""
        if self.engine.has_schedulable_requests():
            return 0.0
        if self.engine.has_unfinished_requests():
            return 0.001  # only waiting for remote KV: poll for it soon
        return 0.5

    def _drain(self, wait_s: float) -> bool:
        """Apply queued commands, waiting up to `wait_s` for the first. False on shutdown."""
        while True:
            try:
                cmd = (
                    self._commands.get(timeout=wait_s)
                    if wait_s > 0
                    else self._commands.get_nowait()
                )
            except queue.Empty:
                return True
            wait_s = 0.0
            if cmd is None:
                return False
            self._apply(cmd)

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.priority)
            except Exception as e:  # the caller gets the error; the loop goes on
                self._publish(cmd.request_id, e)
        elif isinstance(cmd, _Abort):
            out = self.engine.abort_request(cmd.request_id)
            if out is not None:
                self._publish(cmd.request_id, out)

    def _poll(self) -> list[tuple[str, Any]]:
        """Hook: outputs or errors that arrived from outside the engine, per request id."""
        return []

    def _on_exit(self) -> None:
        """Hook: runs on the engine thread when the loop ends."""

    def _publish(self, request_id: str, item: Any) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, out_queue = entry
        try:
            loop.call_soon_threadsafe(out_queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening
