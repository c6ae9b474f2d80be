"""`PairLink`: a channel's 2-rank communicator, used the way NCCL must be used.

Operations are posted in the order both sides agreed on (NCCL matches by issue order, not by
tag) and return at once; completion is learned from an event recorded after them, queried from
the host without blocking (a CUDA event on the link's own stream, never the compute stream:
the decode step never waits for an incoming transfer); a channel that makes no progress within
its timeout is aborted by its owner (a lost peer raises nothing under NCCL). Three kinds:

- `nccl`: `ProcessGroupNCCL` between CUDA caches, on a dedicated stream per link. (Not
  exercised in CI: no GPU there.)
- `nccl-emulated`: the same code over `EmulatedNcclGroup` (gloo with NCCL's semantics) on CPU.
- `gloo`: a plain gloo pair group on CPU; a failed operation raises `LinkError` from the events
  that cover it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.distributed as dist

from duet.kv_transfer.torch_dist.landing import LinkError, WorkLanding
from duet.kv_transfer.torch_dist.nccl_emu import EmulatedNcclGroup

__all__ = ["LinkError", "LinkEvent", "LinkMark", "PairLink", "link_kind", "open_link"]

WATCHDOG_FACTOR = 4
"""NCCL's (and the emulation's) own operation timeout is this many transfer timeouts: the
channel's owner aborts a stalled link at one, before NCCL's watchdog (which by default tears
the whole process down) would."""
EVENT_POLL_S = 0.0005  # between queries of a CUDA event being waited for
NCCL_ASYNC_ERROR_HANDLING = "2"
"""`TORCH_NCCL_ASYNC_ERROR_HANDLING` for the KV links' NCCL groups: 2 is PyTorch's CleanUpOnly
(on a timed-out operation its watchdog aborts the communicator and fails the work, but leaves
the process up). PyTorch's default tears the process down, which would take a worker's every
other request and channel with one lost peer; duet aborts a stalled channel itself at one
transfer timeout (the watchdog's is `WATCHDOG_FACTOR` of them). Chosen from PyTorch's
documentation; `make gpu-check`'s NCCL probe measures both settings on a GPU."""


def set_nccl_error_handling() -> None:
    """Set `TORCH_NCCL_ASYNC_ERROR_HANDLING` to `NCCL_ASYNC_ERROR_HANDLING` unless the operator
    set it. PyTorch reads it when a process group is built, so the KV links built after this
    get it; the tensor-parallel group, built earlier at start-up, keeps the default (a rank
    that lost its group is of no use and is better torn down and restarted)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ASYNC_ERROR_HANDLING)


class LinkEvent(Protocol):
    """Completes once every operation posted on its link before it completed."""

    def query(self) -> bool:
        """Never blocks; raises LinkError when a covered operation failed (gloo only)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """`query`, waiting up to `timeout_s` for it to be True."""
        ...


class LinkMark(Protocol):
    """A point in a link's operations, timed as the device times them: a CUDA event on the
    link's stream (NCCL), the wall time at which the operations before it landed (CPU)."""

    def seconds_since(self, earlier: LinkMark) -> float:
        """Time from `earlier` (a mark of the same link, made before) to this one; valid once
        an event recorded after both completed."""
        ...


class PairLink(ABC):
    """One channel's side. `send`/`recv` are called from one thread, in the order the peer
    posts the matching operations; `record`'s events may be queried from any thread."""

    kind: str

    @abstractmethod
    def send(self, tensor: torch.Tensor, tag: int, after: Any = None) -> None:
        """Post a send of `tensor` (not to be written until an event recorded after it
        completes); on CUDA it starts once the CUDA event `after` (the gather) completed."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        """Post a receive into `tensor`, whose data is there once an event recorded after it
        completes (and not before: read it earlier and you read garbage)."""

    @abstractmethod
    def record(self) -> LinkEvent:
        """An event covering every operation posted so far."""

    @abstractmethod
    def mark(self) -> LinkMark:
        """A mark after every operation posted so far (the link probe's clock)."""

    @abstractmethod
    def abort(self) -> None:
        """Give up: pending operations never complete and nothing is written after this returns;
        the link is unusable (the peer's operations stay pending or fail)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop the link's helper thread, if any (the channel is closing)."""

    def hold(self) -> None:
        """Tests: completed operations do not land (their events stay pending) until
        `release`. CPU links only."""
        raise NotImplementedError(f"{self.kind}: cannot hold landings")

    def release(self) -> None:
        raise NotImplementedError(f"{self.kind}: cannot hold landings")


class GlooLink(PairLink):
    kind = "gloo"

    def __init__(self, group: Any, peer: int, name: str) -> None:
        self._group, self._peer = group, peer
        self._landing = WorkLanding(name, raise_errors=True)

    def send(self, tensor: torch.Tensor, tag: int, after: Any = None) -> None:
        self._post(self._group.send, tensor, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self._post(self._group.recv, tensor, tag)

    def _post(self, op: Any, tensor: torch.Tensor, tag: int) -> None:
        try:
            work = op([tensor], self._peer, tag)
        except Exception as e:  # the pair is closed already
            raise LinkError(str(e)) from e
        self._landing.post(work)

    def record(self) -> LinkEvent:
        return self._landing.event()

    def mark(self) -> LinkMark:
        return self._landing.mark()

    def abort(self) -> None:
        self._landing.close()
        self._group.abort()

    def close(self) -> None:
        self._landing.close()

    def hold(self) -> None:
        self._landing.hold()

    def release(self) -> None:
        self._landing.release()


class NcclLink(PairLink):
    """NCCL (CUDA) or its emulation (CPU): one code path. `Work.wait()` makes the link's stream
    wait for the operation, not the host; an event recorded on that stream tells the host."""

    def __init__(self, group: Any, peer: int, device: torch.device) -> None:
        self.kind = "nccl" if device.type == "cuda" else "nccl-emulated"
        self._group, self._peer = group, peer
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def send(self, tensor: torch.Tensor, tag: int, after: Any = None) -> None:
        with self._on_stream():
            if after is not None:
                torch.cuda.current_stream().wait_event(after)
            self._group.send([tensor], self._peer, tag).wait()

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        with self._on_stream():
            self._group.recv([tensor], self._peer, tag).wait()

    def record(self) -> LinkEvent:
        if self._stream is None:
            event: LinkEvent = self._group.record_event()
            return event
        cuda_event = torch.cuda.Event()
        cuda_event.record(self._stream)
        return CudaEvent(cuda_event)

    def mark(self) -> LinkMark:
        if self._stream is None:
            wall: LinkMark = self._group.mark()
            return wall
        cuda_event = torch.cuda.Event(enable_timing=True)
        cuda_event.record(self._stream)
        return CudaMark(cuda_event)

    def abort(self) -> None:
        self._group.abort()

    def close(self) -> None:
        if isinstance(self._group, EmulatedNcclGroup):
            self._group.close()

    def hold(self) -> None:
        if not isinstance(self._group, EmulatedNcclGroup):
            super().hold()
        self._group.hold()

    def release(self) -> None:
        if not isinstance(self._group, EmulatedNcclGroup):
            super().release()
        self._group.release()


class CudaEvent:
    def __init__(self, event: Any) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout_s: float) -> bool:
        # NOTE: polled, never `synchronize()`: that has no timeout, and a lost peer never
        # completes the event.
        deadline = time.monotonic() + timeout_s
        while not self.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(EVENT_POLL_S)
        return True


class CudaMark:
    def __init__(self, event: Any) -> None:
        self._event = event

    def seconds_since(self, earlier: LinkMark) -> float:
        assert isinstance(earlier, CudaMark)
        return float(earlier._event.elapsed_time(self._event)) / 1000.0


def link_kind(device: torch.device, emulate_nccl: bool) -> str:
    """What a channel's tensors go over; both sides must agree (the handshake checks)."""
    if device.type == "cuda":
        return "nccl"
    return "nccl-emulated" if emulate_nccl else "gloo"


def open_link(
    store: dist.Store,
    rank: int,
    device: torch.device,
    timeout_s: float,
    emulate_nccl: bool,
    name: str,
) -> PairLink:
    """This side (`rank` 0 sends, 1 receives) of a channel's link, over `store` (the channel's
    prefix); waits up to `timeout_s` for the peer to open its side."""
    peer = 1 - rank
    watchdog = datetime.timedelta(seconds=WATCHDOG_FACTOR * timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = watchdog
        return NcclLink(dist.ProcessGroupNCCL(store, rank, 2, options), peer, device)
    if emulate_nccl:
        group = dist.ProcessGroupGloo(store, rank, 2, watchdog)
        return NcclLink(EmulatedNcclGroup(group, name), peer, device)
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))
    return GlooLink(group, peer, name)
