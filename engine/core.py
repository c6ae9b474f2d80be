"""`EngineCore`: the one engine thread that every role (aggregated server, prefill worker,
decode worker) runs its `LLMEngine` on.

The core owns:
- the thread, and the only code that touches the `LLMEngine` after construction;
- a closed set of typed commands (`EngineCommand`, engine/commands.py) that other threads
  submit;
- for tensor parallelism, the broadcast of each iteration's commands from rank 0 to the other
  ranks, so that every rank's scheduler makes the same decisions and the collectives line up;
- the step loop: apply commands, `role.before_step`, `engine.step_outputs()`,
  `role.after_step`;
- per-request result streams, flushed once per iteration: all of an iteration's results for
  the requests of one event loop travel in one hand-off (`call_soon_threadsafe`), not one per
  request per token. Results are raw `EngineOutput`s (token ids): each stream's reader makes
  the text and matches stop strings (`OutputAssembler`, in `iterate`), off the engine thread,
  and sends a `FinishStopped` back when a stop string ends a sample.

What differs between roles lives in an `EngineRole` (hooks the core calls on its thread).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from duet.engine.commands import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    FinishStopped,
    ReleaseHeld,
    ReserveRemote,
    ResetPrefixCache,
    Stop,
)
from duet.engine.device import bind_thread
from duet.engine.engine_role import EngineDeadError, EngineRole
from duet.engine.errors import InvalidInputError, ModelLoadError
from duet.engine.llm_engine import LLMEngine
from duet.engine.output_processor import OutputAssembler
from duet.engine.outputs import RequestOutput
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.peer_lockstep import PEER_IDLE_WAIT_S, PeerLockstep

__all__ = [  # the commands (engine.commands) and the role (engine.engine_role) with the core
    "AbortRequest",
    "AddRequest",
    "EngineCommand",
    "EngineCore",
    "EngineDeadError",
    "EngineRole",
    "FinishStopped",
    "ReleaseHeld",
    "ReserveRemote",
    "ResetPrefixCache",
    "Stop",
]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""Longest wait for a command while idle; also rank 0's heartbeat to its followers."""
IO_POLL_S = 0.001
"""Wait between iterations while only I/O (remote KV, transfers) is pending."""
STARTUP_TIMEOUT_S = 1800.0
"""Longest wait for an engine built on the core's thread (model load, KV pool) to be ready."""


# -- the core -------------------------------------------------------------------------------


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]


class EngineCore:
    """NOTE: give the core a function that builds the engine, not a built engine, in serving
    processes. torch's CPU ops run on GNU OpenMP, which keeps one pool of worker threads per
    thread that ever ran a parallel region; once the process has more pool threads than
    cores (the loading thread's pool plus the engine thread's), libgomp throttles spinning and
    its workers sleep between parallel regions, so every region of every step pays for futex
    wake-ups (measured on a 2-core EPYC, SmolLM2: 28 -> 37 ms per decode step in fp32, 19.6
    -> 29 ms in bf16, ~100 voluntary context switches per step instead of ~0). Built on the
    core's thread, the engine's thread is the only one with a pool."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        role: EngineRole | None = None,
        *,
        name: str = "engine",
        tp: TensorParallel = SINGLE,
        control_group: dist.ProcessGroup | None = None,
        start: bool = True,
        peers: PeerLockstep | None = None,
    ) -> None:
        """`engine`: the engine, or a function the core's thread calls to build it (see the
        class note); `wait_ready` then returns once it is built and the role started.
        `tp`: this rank's group; with more than one rank, rank 0 takes commands and every
        iteration broadcasts them over `control_group` (default `tp.group`, which must then be
        gloo) to the followers, which take none of their own. `start=False`: call `start()`
        once the role is fully built. `peers`: data-parallel peers this engine steps with
        (engine/peer_lockstep.py), each taking its own commands."""
        self._build: Callable[[], LLMEngine] | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
            engine.assemble_outputs = False  # the streams' readers assemble (see `iterate`)
        else:
            self._build = engine
        self._ready = threading.Event()
        self.role = role or EngineRole()
        self.name = name
        self.tp = tp
        self.peers = peers
        self._control_group = control_group if control_group is not None else tp.group
        self._commands: queue.Queue[EngineCommand] = queue.Queue()
        self._internal: list[EngineCommand] = []  # rank 0's own follow-ups (engine thread)
        self._streams: dict[str, _Stream] = {}
        self._pending: list[tuple[str, Any]] = []  # published this iteration (engine thread)
        self._lock = threading.Lock()
        self._counter = 0
        self._dead: BaseException | None = None
        self.role.attach(self)
        self._thread = threading.Thread(target=self._run, name=f"duet-{name}", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the engine is built and the role started; raise what failed them."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start within {timeout_s:g}s")
        with self._lock:
            error = self._dead
        if error is not None and not self._thread.is_alive():
            raise error

    # -- any thread ---------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def failed(self) -> bool:
        """Whether the engine ended by a failure (its step or a collective raised: a peer
        killed, say), not by a shutdown or a data-parallel peer's orderly stop."""
        with self._lock:
            return self._dead is not None and not isinstance(self._dead, EngineDeadError)

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The gloo group over the engine's ranks that carries its commands (None: one rank);
        roles agree on their own inputs over it (kv_transfer/rank_agreement.py)."""
        return self._control_group

    @property
    def dead(self) -> BaseException | None:
        """Why the loop ended (None while it runs)."""
        return self._dead

    def submit(self, cmd: EngineCommand) -> None:
        self._commands.put(cmd)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (followers stop with rank 0) and wait up to `timeout_s` for it."""
        self._commands.put(Stop())
        self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Block until the loop ends (a follower rank's main thread waits here)."""
        self._thread.join(timeout_s)

    def open_stream(self, request_id: str | None) -> tuple[str, asyncio.Queue[Any]]:
        """Register the results stream of a request about to be submitted (a fresh id when
        None), on the running event loop. Raises `EngineDeadError` once the loop ended and
        `InvalidInputError` for an id that already has a stream."""
        with self._lock:
            # Checked under the lock: the loop marks itself dead under it before it notifies
            # the registered streams, so a stream is either notified or refused here.
            if self._dead is not None:
                raise EngineDeadError(f"{self.name} is not running") from self._dead
            if request_id is None:
                self._counter += 1
                request_id = f"req-{self._counter}"
            if request_id in self._streams:
                raise InvalidInputError("request_id", f"{request_id!r} is already running")
            out_queue: asyncio.Queue[Any] = asyncio.Queue()
            self._streams[request_id] = _Stream(asyncio.get_running_loop(), out_queue)
        return request_id, out_queue

    def close_stream(self, request_id: str, finished: bool) -> None:
        """Unregister a request's stream; abort the request unless it finished. Idempotent."""
        with self._lock:
            registered = self._streams.pop(request_id, None) is not None
        if registered and not finished:
            self._commands.put(AbortRequest(request_id))

    async def iterate(
        self, request_id: str, out_queue: asyncio.Queue[Any], assembler: OutputAssembler
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs, assembled from its `EngineOutput`s on the caller's
        thread, until one is finished; exceptions published for it are raised. A stop string
        the assembler finds ends its sample in the engine (`FinishStopped`). Leaving early
        aborts the request."""
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                out = assembler.add(item)
                for index, num_tokens in assembler.take_stops():
                    self.submit(FinishStopped(request_id, index, num_tokens))
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.close_stream(request_id, finished)

    # -- engine thread ------------------------------------------------------------------------

    def submit_internal(self, cmd: EngineCommand) -> None:
        """Engine thread, rank 0: apply `cmd` at the next iteration, broadcast like the rest."""
        self._internal.append(cmd)

    def publish(self, request_id: str, item: Any) -> None:
        """Engine thread: queue `item` for the request's stream; sent at the iteration's end."""
        self._pending.append((request_id, item))

    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
                self.engine.assemble_outputs = False  # the streams' readers assemble
            bind_thread(self.engine.device)  # per thread: an engine built elsewhere too
            self.role.start()
        except BaseException as e:  # start-up failed: `wait_ready` raises it
            if isinstance(e, InvalidInputError | ModelLoadError):  # the user's: the caller says it
                logger.debug("%s failed to start: %s", self.name, e)
            else:
                logger.exception("%s failed to start", self.name)
            with self._lock:
                self._dead = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if self.tp.spans_ranks:
                    commands = self.tp.broadcast_commands(commands, self._control_group)
                running = self._apply(commands)
                if running:
                    self.role.before_step()
                step = running
                if self.peers is not None:  # every peer steps, or none (engine/peer_lockstep.py)
                    work = running and self.engine.has_schedulable_requests()
                    step, any_stop = self.peers.agree(work, not running)
                    if any_stop and running:  # another peer's
                        logger.info("%s stops with a data-parallel peer", self.name)
                        with self._lock:
                            self._dead = EngineDeadError(
                                f"{self.name} stopped with a data-parallel peer"
                            )
                        break
                if not running:
                    break
                outputs = self.engine.step_outputs() if step else []
                self.role.after_step(outputs)
                self._flush()
        except BaseException as e:  # any failure must reach every waiting caller
            logger.exception("%s loop failed", self.name)
            with self._lock:
                self._dead = e
        finally:
            self._flush()
            with self._lock:
                if self._dead is None:
                    self._dead = EngineDeadError(f"{self.name} shut down")
                streams = list(self._streams)
            error = self._dead if isinstance(self._dead, EngineDeadError) else None
            for request_id in streams:
                self.publish(request_id, error or EngineDeadError(str(self._dead)))
            self._flush()
            try:
                self.role.on_exit()
            except Exception:
                logger.exception("%s role failed to clean up", self.name)

    def _wait_s(self) -> float:
        """How long the loop may wait for a command before stepping again."""
        if self._internal or self.engine.has_schedulable_requests() or self.role.busy_elsewhere():
            return 0.0
        if self.peers is not None and self.peers.others_busy:
            return 0.0
        if self.engine.has_unfinished_requests() or self.role.has_io_in_flight():
            return IO_POLL_S
        return IDLE_WAIT_S if self.peers is None else PEER_IDLE_WAIT_S

    def _next_commands(self) -> list[EngineCommand]:
        if not self.tp.is_leader:
            return []  # followers take rank 0's commands from the broadcast
        # NOTE: copy and clear, not swap: a frozen start-up list (engine.heap) freed each
        # iteration would shrink the frozen generation under `gc.get_freeze_count`.
        commands = list(self._internal)
        self._internal.clear()
        wait_s = 0.0 if commands else self._wait_s()
        try:
            if wait_s > 0:
                commands.append(self._commands.get(timeout=wait_s))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _apply(self, commands: Sequence[EngineCommand]) -> bool:
        """Apply rank 0's commands, in order, on this rank. False on stop."""
        role = self.role
        for cmd in commands:
            if isinstance(cmd, Stop):
                return False
            if isinstance(cmd, AbortRequest):
                role.abort(cmd)
            elif isinstance(cmd, FinishStopped):
                role.finish_stopped(cmd)
            elif isinstance(cmd, ReleaseHeld):
                role.release(cmd)
            elif isinstance(cmd, ResetPrefixCache):
                role.engine.kv.pool.reset_prefix_cache()
            else:
                try:
                    if isinstance(cmd, AddRequest):
                        role.add(cmd)
                    else:
                        role.reserve(cmd)
                except Exception as e:  # the caller's error; the loop goes on
                    self.publish(cmd.request_id, e)
        return True

    def _flush(self) -> None:
        """Hand this iteration's results to their streams: one call per event loop."""
        if not self._pending:
            return
        pending = list(self._pending)
        self._pending.clear()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for request_id, item in pending:
                stream = self._streams.get(request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is listening


def _deliver(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for out_queue, item in items:
        out_queue.put_nowait(item)
