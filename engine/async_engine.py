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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import InvalidInputError
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

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
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
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
        self._commands.put(_Add(request_id, prompt, params, priority))
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
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
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
                block = not self.engine.has_unfinished_requests()
                if not self._drain(block):
                    break
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

    def _drain(self, block: bool) -> bool:
        """Apply queued commands. Returns False on shutdown."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block and not self.engine.has_unfinished_requests():
                    continue  # idle: keep waiting for work
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id, cmd.priority)
                except Exception as e:  # the caller gets the error; the loop goes on
                    self._publish(cmd.request_id, e)
            else:
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._publish(cmd.request_id, out)

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
