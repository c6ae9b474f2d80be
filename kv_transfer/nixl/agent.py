"""`AgentLoop`: one side's NIXL agent and the one thread that makes every call into it.

The agent is built without NIXL's own progress thread (it spins a core even when idle) and
with no thread synchronisation of its own, so every call into it runs on this loop's thread:
other threads hand it work (`submit`, or `call` to wait for a result, bounded). Each turn the
loop runs what it was handed, checks the transfers it posted (DONE, ERR, or past their
deadline: cancelled), reads the notifications peers sent (UCX makes progress inside these
calls), and calls the owner's `on_tick`. It waits for work at most `BUSY_TICK_S` while anything
is in flight, `IDLE_TICK_S` otherwise: a notification waits at most that long to be read.

Memory: every cache tensor is registered whole at start-up (CPU or CUDA memory alike) and stays
registered until `close`; a transfer names ranges inside them (`regions.pair_descs`).

Control messages between the two sides of a channel are NIXL notifications carrying JSON
(`notify`, `on_message`); a transfer may carry one, delivered after its data has landed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

BUSY_TICK_S = 0.0005
IDLE_TICK_S = 0.002
GET_ZCOPY_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api")
"""Where the NIXL Python API lives: the PyPI wheels nixl-cu12 / nixl-cu13, or a source build's
`nixl` package."""


def load_nixl() -> Any:
    """The NIXL module (`nixl_agent`, `nixl_agent_config`); ImportError saying how to install
    it when none is."""
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        # NOTE: UCX's memory-type cache learns of CUDA allocations from hooks it installs when
        # its first context starts; a KV cache allocated before that (every worker's: the
        # engine sizes its pool first) is then taken for host memory, and NIXL refuses to
        # register it ("VRAM memory is detected as host by UCX", NIXL_ERR_BACKEND; seen on an
        # H200 with nixl-cu12 1.5.1, openucx/ucx#2755). Without the cache UCX asks the driver.
        os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
        if torch.cuda.is_available():
            # NOTE: UCX serves a READ of CUDA memory over CUDA IPC only where it finds NVLink
            # ("cuda-ipc get zcopy disabled as no nvlinks detected"); elsewhere (one GPU, PCIe
            # GPUs) it emulates the read in software over TCP: a pull moved 0.07 GB/s on an
            # H200 against 698 GB/s for a NIXL WRITE of the same bytes (2026-11-30; vLLM
            # #52607, NIXL #2208). Not set without CUDA, where UCX warns of an unused variable.
            os.environ.setdefault(GET_ZCOPY_ENV, "on")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NOTE: NIXL logs INFO lines (an agent made, a backend loaded) to stdout, which a
            # worker's parent may read as its protocol; only its warnings, unless asked.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise ImportError(
        "kv_backend 'nixl' needs NIXL: pip install nixl-cu12 (keep torch pinned: "
        "PIP_CONSTRAINT=constraints.txt), or `make install`"
    )


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


@dataclass
class Posted:
    """A transfer this agent posted, until it ends."""

    handle: Any
    peer: str
    deadline: float  # monotonic: cancelled (and failed) if still running then
    on_end: Callable[[str | None], None]  # None: DONE; else why it failed


class AgentLoop:
    def __init__(
        self,
        name: str,
        memory: list[torch.Tensor],
        on_message: Callable[[str, dict[str, Any]], None],
        on_tick: Callable[[], None] = lambda: None,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        """An agent named after `name` (plus a random suffix: a restarted worker is a new
        agent), with `memory` registered. `on_message(peer, message)` and `on_tick()` run on
        the loop's thread; `busy()` says whether the owner has work in flight (short ticks)."""
        nixl = load_nixl()
        self.agent_name = f"{name}-{uuid.uuid4().hex[:12]}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl.nixl_agent(self.agent_name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("kv_backend 'nixl': NIXL's UCX backend did not load")
        self._registered = self._agent.register_memory(memory)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._on_message = on_message
        self._on_tick = on_tick
        self._busy = busy
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._posted: list[Posted] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-nixl-{name}", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the loop's thread, soon (its exceptions are logged)."""
        self._jobs.put(job)

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run `fn` on the loop's thread and return its result (or raise its exception);
        TimeoutError when it has not run within `timeout_s`."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

        self.submit(job)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"the NIXL agent's thread did not answer within {timeout_s} s"
            ) from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, cancel what is in flight, deregister the memory."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV agent %s: its thread did not stop", self.agent_name)
            return
        for posted in self._posted:
            self._release(posted)
        self._posted.clear()
        try:
            self._agent.deregister_memory(self._registered)
        except Exception as e:  # the process is going away anyway
            logger.warning("KV agent %s: deregistering its memory failed: %s", self.agent_name, e)

    # -- the loop's thread ------------------------------------------------------------------

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def drop_peer(self, peer: str) -> None:
        """Forget a peer (and disconnect from it); its transfers in flight are failed."""
        for posted in [p for p in self._posted if p.peer == peer]:
            self._end(posted, f"agent {peer} left")
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:  # not known (any more)
            logger.debug("KV agent %s: dropping %s: %s", self.agent_name, peer, e)

    def notify(self, peer: str, message: dict[str, Any]) -> None:
        """Send `message` to `peer`; raises when it cannot be handed to the transport."""
        self._agent.send_notif(peer, encode(message))

    def post(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        mem_types: tuple[str, str],
        timeout_s: float,
        on_end: Callable[[str | None], None],
        message: dict[str, Any] | None = None,
    ) -> Posted | None:
        """Start a READ or WRITE of `local` from / to `remote` descriptors (`[N, 3]` arrays) at
        `peer`, with `message` delivered to the peer once the data landed. `on_end(None)` when
        it is done, `on_end(why)` when it failed or ran past `timeout_s` (then cancelled),
        exactly once, on this thread (possibly before `post` returns: None is returned then)."""
        posted = None
        try:
            local_list = self._agent.get_xfer_descs(local, mem_types[0])
            remote_list = self._agent.get_xfer_descs(remote, mem_types[1])
            notif = encode(message) if message is not None else b""
            handle = self._agent.initialize_xfer(op, local_list, remote_list, peer, notif)
            posted = Posted(handle, peer, time.monotonic() + timeout_s, on_end)
            state = self._agent.transfer(handle)
        except Exception as e:
            if posted is not None:
                self._release(posted)
            on_end(f"{op} from agent {peer}: {e}")
            return None
        if state == "DONE":
            self._release(posted)
            on_end(None)
            return None
        if state != "PROC":
            self._end(posted, f"{op} at agent {peer}: {state}")
            return None
        self._posted.append(posted)
        return posted

    def cancel(self, posted: Posted, why: str) -> None:
        """End a transfer in flight (its `on_end` gets `why`); no-op if it ended already."""
        if posted in self._posted:
            self._end(posted, why)

    def _end(self, posted: Posted, why: str | None) -> None:
        if posted in self._posted:
            self._posted.remove(posted)
        released = self._release(posted)
        if not released and why is not None:
            # NOTE: NIXL could not cancel it: disconnect, so nothing more of it moves.
            try:
                self._agent.remove_remote_agent(posted.peer)
            except Exception:
                pass
            why += "; the peer was disconnected"
        posted.on_end(why)

    def _release(self, posted: Posted) -> bool:
        try:
            self._agent.release_xfer_handle(posted.handle)
            return True
        except Exception as e:
            logger.warning("KV agent %s: cancelling a transfer failed: %s", self.agent_name, e)
            return False

    def _check_posted(self) -> None:
        now = time.monotonic()
        for posted in list(self._posted):
            try:
                state = self._agent.check_xfer_state(posted.handle)
            except Exception as e:
                state = f"ERR ({e})"
            if state == "DONE":
                self._end(posted, None)
            elif state != "PROC":
                self._end(posted, f"transfer with agent {posted.peer}: {state}")
            elif now >= posted.deadline:
                self._end(posted, f"transfer with agent {posted.peer}: no progress, timed out")

    def _read_messages(self) -> None:
        for peer, messages in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            for raw in messages:
                try:
                    message = json.loads(raw)
                except ValueError:
                    logger.warning("KV agent %s: unreadable message from %s", self.agent_name, name)
                    continue
                self._on_message(name, message)

    def _run(self) -> None:
        while not self._closed.is_set():
            tick = BUSY_TICK_S if self._posted or self._busy() else IDLE_TICK_S
            try:
                job = self._jobs.get(timeout=tick)
                while job is not None:
                    self._guard(job)
                    job = self._jobs.get_nowait()
            except queue.Empty:
                pass
            if self._closed.is_set():
                break
            self._guard(self._check_posted)
            self._guard(self._read_messages)
            self._guard(self._on_tick)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            logger.exception("KV agent %s: error on its thread", self.agent_name)
