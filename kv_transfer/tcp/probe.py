"""The tcp backend's link probe (`LinkProber` runs it, kv_transfer/link_probe.py).

A channel of its own to the receiver, opened as a transfer channel is (authentication,
handshake, every stripe), so the probe goes the way the transfers go and never shares their
sockets or threads. Over it:

- `{"type": "ping", "nbytes", "stripes"}` and `nbytes` bytes, striped as a `kv` frame's payload
  is; the receiver reads them, drops them, and answers
- `{"type": "pong", "nbytes"}` once every byte is in.

A ping without payload gives the round trip; the rate is a burst's bytes over its time (sent to
answered) less that round trip, the best of `BURSTS` bursts (the first also opens up the new
connections' TCP windows). A burst is `PROBE_BYTES_PER_STRIPE` per connection, so it goes over
every stripe, as the largest transfers do: 16 MiB over the default 2 stripes, once per
receiver. Every socket operation gives up after the sender's `timeout_s` without progress;
`cancel` shuts the probe's connections down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from duet.kv_transfer import sockio
from duet.kv_transfer.tcp.framing import frame, read_frame
from duet.kv_transfer.tcp.stripes import MAX_STRIPES, STRIPE_MIN_BYTES, Stripes

PROBE_BYTES_PER_STRIPE = STRIPE_MIN_BYTES
MAX_PROBE_BYTES = MAX_STRIPES * PROBE_BYTES_PER_STRIPE  # what a receiver reads for one ping
BURSTS = 2


class TcpProbe:
    """`Probe` over channels that `dial(dest)` opens (the sender's own handshake)."""

    def __init__(self, dial: Callable[[str], Stripes]) -> None:
        self._dial = dial
        self._lock = threading.Lock()
        self._open: list[Stripes] = []
        self._cancelled = False

    def measure(self, dest: str) -> float:
        stripes = self._dial(dest)
        with self._lock:
            if self._cancelled:
                stripes.close()
                raise ConnectionError("the sender is closing")
            self._open.append(stripes)
        try:
            return burst_gbps(stripes)
        finally:
            with self._lock:
                self._open.remove(stripes)
            stripes.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            for stripes in self._open:
                stripes.shutdown()


def burst_gbps(stripes: Stripes) -> float:
    """GB/s of the best of `BURSTS` timed bursts over every connection of `stripes`."""
    payload = torch.zeros(PROBE_BYTES_PER_STRIPE * len(stripes.socks), dtype=torch.uint8)
    iov = sockio.buffer_iovecs(payload)
    round_trip_s = ping(stripes, None)
    best_s = float("inf")
    for _ in range(BURSTS):
        elapsed_s = ping(stripes, iov)
        # NOTE: never below half the burst: a round trip that happened to be slow would
        # otherwise make a fast burst look arbitrarily faster.
        best_s = min(best_s, max(elapsed_s - round_trip_s, elapsed_s / 2))
    return payload.nbytes / best_s / 1e9


def ping(stripes: Stripes, iov: torch.Tensor | None) -> float:
    """Seconds from sending a ping (with the bytes `iov` points at, over every connection) to
    its pong."""
    nbytes = int(iov[:, 1].sum()) if iov is not None else 0
    count = len(stripes.socks) if iov is not None else 1
    head = frame({"type": "ping", "nbytes": nbytes, "stripes": count})
    start = time.monotonic()
    if iov is None:
        stripes.socks[0].sendall(head)
    else:
        stripes.move(iov, send=True, stripes=count, head=head)
    answer = read_frame(stripes.socks[0])
    elapsed_s = time.monotonic() - start
    if answer.get("type") != "pong" or answer.get("nbytes") != nbytes:
        raise ConnectionError(f"the receiver answered a ping of {nbytes} bytes with {answer}")
    return elapsed_s
