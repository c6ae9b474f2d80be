"""`EmulatedNcclGroup`: a gloo pair group that behaves as NCCL does, so CI (no GPU) runs the
code path a GPU runs and sees the failures gloo hides.

What differs from gloo, and what the emulation therefore does:

- NCCL ignores the `tag` of send/recv: messages between two ranks match in issue order. The
  n-th send meets the n-th receive, so a receiver that posts in another order than its sender
  gets another message's bytes (or, with sizes that differ, never completes).
- `Work.wait()` does not block the host: it makes the current stream wait. The emulated `wait`
  returns at once; a receive lands in a shadow buffer and is copied into its tensor only when
  the emulated event (`record_event`, standing for a CUDA event recorded on the stream after
  the work) completes, and the tensor holds NaN (poison) until then: code that reads it after
  `wait` reads garbage, as it would on a GPU.
- A lost peer raises nothing: the operation stays pending until the group is aborted (NCCL's
  watchdog would tear the process down at its timeout, which the caller sets far beyond its
  own deadline).

Selected with `emulate_nccl=True` in the torch_dist configs, whose default is the environment
variable `DUET_KV_EMULATE_NCCL=1` (read by every worker process), on CPU caches only.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from duet.kv_transfer.torch_dist.landing import LandingEvent, WallMark, WorkLanding

ENV = "DUET_KV_EMULATE_NCCL"


def emulate_nccl_from_env() -> bool:
    """`DUET_KV_EMULATE_NCCL`: "1" on, "0" or unset off; anything else is an error naming it."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: must be 0 or 1, got {value!r}")
    return value == "1"


class EmulatedWork:
    """An NCCL work as the host sees it: `wait` returns before the data has landed."""

    def __init__(self, event: LandingEvent) -> None:
        self._event = event

    def wait(self, timeout: Any = None) -> bool:
        return True  # NCCL: the current stream waits, not the host

    def is_completed(self) -> bool:
        try:
            return self._event.query()
        except Exception:
            return False  # never raises: emulation errors are swallowed anyway


class EmulatedNcclGroup:
    """A 2-rank gloo group with NCCL's semantics (see the module docstring). `send` and `recv`
    are called from one thread each side (as a channel does); `abort` from any thread.

    Matching: the n-th send meets the n-th receive whatever their tags (gloo tags 2n and 2n+1
    carry the message's size and its bytes). A receive whose size differs from the message's
    never completes, nor does anything after it (NCCL hangs; gloo would abort the process)."""

    def __init__(self, group: Any, name: str) -> None:
        self._group = group
        self._landing = WorkLanding(name, raise_errors=False)
        self._num_sends = itertools.count()
        self._num_recvs = itertools.count()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        [tensor] = tensors
        n = next(self._num_sends)
        size = torch.tensor([tensor.nbytes], dtype=torch.int64)
        works = [self._post(self._group.send, size, dst, 2 * n)]
        works.append(self._post(self._group.send, tensor, dst, 2 * n + 1))
        self._landing.post(_Sent(works, size))
        return EmulatedWork(self._landing.event())

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        [tensor] = tensors
        n = next(self._num_recvs)
        size = torch.empty(1, dtype=torch.int64)
        sized = self._post(self._group.recv, size, src, 2 * n)
        shadow = torch.empty_like(tensor)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        received = _Received(self._group, src, 2 * n + 1, shadow, size, sized)
        self._landing.post(received, lambda: tensor.copy_(shadow))
        return EmulatedWork(self._landing.event())

    def _post(self, op: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        try:
            return op([tensor], peer, tag)
        except Exception:
            return None  # a lost peer raises nothing: the operation just never lands

    def record_event(self) -> LandingEvent:
        """`torch.cuda.Event().record(stream)` after `wait` of every work so far."""
        return self._landing.event()

    def mark(self) -> WallMark:
        """A `torch.cuda.Event(enable_timing=True)` recorded after every work so far: when
        they landed."""
        return self._landing.mark()

    def hold(self) -> None:
        """Tests: data that comes in does not land (its events stay pending) until `release`."""
        self._landing.hold()

    def release(self) -> None:
        self._landing.release()

    def abort(self) -> None:
        """As `ProcessGroupNCCL.abort`: pending operations never complete, nothing lands after
        it returns; the peer's operations stay pending (its gloo pair closes, which the
        emulation there swallows)."""
        self._landing.close()
        self._group.abort()

    def close(self) -> None:
        self._landing.close()


class _Sent:
    """A send's two gloo works (its size, its bytes), waited for as one."""

    def __init__(self, works: list[Any], size: torch.Tensor) -> None:
        self._works, self._size = works, size  # the size tensor lives until sent

    def wait(self) -> None:
        for work in self._works:
            if work is None:
                raise RuntimeError("not posted")
            work.wait()


class _Received:
    """A receive: its size first, then (posted from the landing thread, in issue order) its
    bytes into the shadow buffer, unless the sizes differ (then it never completes)."""

    def __init__(
        self, group: Any, src: int, tag: int, shadow: torch.Tensor, size: torch.Tensor, sized: Any
    ) -> None:
        self._group, self._src, self._tag = group, src, tag
        self._shadow, self._size, self._sized = shadow, size, sized

    def wait(self) -> None:
        if self._sized is None:
            raise RuntimeError("not posted")
        self._sized.wait()
        if int(self._size.item()) != self._shadow.nbytes:
            raise RuntimeError(
                f"message of {int(self._size.item())} bytes for a receive of "
                f"{self._shadow.nbytes}: NCCL would hang"
            )
        self._group.recv([self._shadow], self._src, self._tag).wait()
