"""`StagingBuffer`: one step's inputs on their way to the device, in one host buffer (pinned on
CUDA) handed out front to back and copied in one transfer."""

from __future__ import annotations

import numpy as np
import torch

MAX_CACHED_VIEWS = 4096
"""Most views a `StagingBuffer` (or a kernel-table builder) keeps per kind; past this it forgets
them all."""


class StagingBuffer:
    """A host buffer (pinned on CUDA) and its device mirror, handed out front to back each
    step and copied in one transfer: every step's inputs go to the device together."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        self.host, self.dev = host, dev
        self._host_np = host.numpy()
        self.used = 0
        # (start, end) -> the views `take` hands out: steps of one shape take the same spans,
        # and slicing a tensor costs microseconds (made once; bounded, cleared when full).
        self._views: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]] = {}
        # (start, rows, width) -> the [rows, width] views `take_table` hands out.
        self._tables: dict[tuple[int, int, int], tuple[np.ndarray, torch.Tensor]] = {}

    def take(self, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """The next `n` elements: a host view to write and its device mirror."""
        start, self.used = self.used, self.used + n
        views = self._views.get((start, self.used))
        if views is not None:
            return views
        if self.used > self.host.shape[0]:
            raise RuntimeError(f"step inputs overflow the staging buffer ({self.used} > "
                               f"{self.host.shape[0]})")  # fmt: skip
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        views = self._views[start, self.used] = (
            self._host_np[start : self.used],
            self.dev[start : self.used],
        )
        return views

    def take_table(self, rows: int, width: int) -> tuple[np.ndarray, torch.Tensor]:
        """`take(rows * width)` as [rows, width] views."""
        key = (self.used, rows, width)
        views = self._tables.get(key)
        if views is not None:
            self.used += rows * width
            return views
        host, dev = self.take(rows * width)
        if len(self._tables) >= MAX_CACHED_VIEWS:
            self._tables.clear()
        views = self._tables[key] = (host.reshape(rows, width), dev.view(rows, width))
        return views

    def stage(self, values: np.ndarray) -> torch.Tensor:
        """`values` written into the next span; its device mirror."""
        host, dev = self.take(values.shape[0])
        host[:] = values
        return dev

    def copy(self) -> None:
        """Send what this step took to the device and start the next step from the front."""
        if self.dev is not self.host and self.used:
            # Pinned source + non_blocking: the copy overlaps the host's work, no sync.
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)
        self.used = 0
