"""How long a side may touch the other side's blocks, so that neither frees blocks under a
transfer it cannot see.

The side that moves the bytes (the reader in pull mode, the writer in push mode) touches the
other side's blocks; the other side cannot stop it (a posted RDMA or CMA operation needs
nothing from the target's CPU). So whoever hands out blocks (the sender's offer, the receiver's
`dest` in push mode) also hands out a window: the mover starts no operation on them after
`window_end` (the owner's wall clock plus `start_s`) and cancels any still running `run_s`
after it started. The owner then keeps its blocks until the mover said it is done with them,
or until `hold_s` after it handed them out (`start_s + run_s` plus `CLOCK_SKEW_S`), whichever
comes first: a mover that died, stopped or lost its messages (a peer resumed after SIGSTOP
reads its stale offers) finds the window closed and refuses instead of reading reused blocks.

NOTE: the windows compare the two sides' wall clocks: they must agree within `CLOCK_SKEW_S`
(NTP keeps a cluster's nodes within milliseconds; cluster_auth's signed calls already assume
clocks within 30 s, which is no bound for this). A side never reports a transfer failed because
its own deadline passed while the mover may still run, so the bounds stay those of the transfer
timeout: `start_s = run_s = timeout_s / 2`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

CLOCK_SKEW_S = 1.0


@dataclass(frozen=True)
class Window:
    start_s: float  # the mover starts nothing after this long
    run_s: float  # a started operation is cancelled after this long

    @classmethod
    def of_timeout(cls, timeout_s: float) -> Window:
        return cls(timeout_s / 2, timeout_s / 2)

    @property
    def hold_s(self) -> float:
        """How long the owner keeps blocks it handed out when the mover never says."""
        return self.start_s + self.run_s + CLOCK_SKEW_S

    def end(self) -> float:
        """`window_end` of blocks handed out now (this side's wall clock)."""
        return time.time() + self.start_s

    def hold_until(self) -> float:
        """Until when (monotonic) blocks handed out now stay held."""
        return time.monotonic() + self.hold_s


def open_at(window_end: float) -> bool:
    """Whether a mover may start an operation under a window ending at `window_end`."""
    return time.time() < window_end
