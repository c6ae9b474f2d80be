"""`LiveWindow`: the last minutes of a router's latencies and throughput, binned for the
dashboard's live plots (TTFT and inter-token latency percentiles, tokens/s, KV-transfer
bandwidth). Recorded on the event loop as outputs stream; computed when the page asks."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

WINDOW_S = 300.0
"""How far back the plots reach."""
BIN_S = 5.0
"""One point of a plot."""


class LiveWindow:
    def __init__(self, clock: Callable[[], float] = time.time, max_samples: int = 50_000) -> None:
        self._clock = clock
        self.ttft_s: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.itl_s: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.tokens: deque[tuple[float, int]] = deque(maxlen=max_samples)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s.append((self._clock(), seconds))

    def observe_itl(self, seconds: float) -> None:
        self.itl_s.append((self._clock(), seconds))

    def count_tokens(self, num_tokens: int) -> None:
        self.tokens.append((self._clock(), num_tokens))

    def series(self, transfers: Iterable[tuple[float, float, float]] = ()) -> dict[str, Any]:
        """Per bin over the window: `t` (bin end, epoch seconds), TTFT and ITL p50/p90/p99 in
        ms (None where a bin saw none), `tokens_per_s`, and `transfer_gbps` from `transfers`
        given as (finished_at, bytes, seconds): bytes moved over time spent, per bin."""
        now = self._clock()
        num_bins = int(WINDOW_S / BIN_S)
        start = now - num_bins * BIN_S
        ttft = _binned(self.ttft_s, start, num_bins)
        itl = _binned(self.itl_s, start, num_bins)
        tokens = [0.0] * num_bins
        for t, n in self.tokens:
            if t >= start:
                tokens[min(num_bins - 1, int((t - start) / BIN_S))] += n
        moved = [[0.0, 0.0] for _ in range(num_bins)]
        for t, num_bytes, seconds in transfers:
            if t >= start and seconds > 0:
                b = moved[min(num_bins - 1, int((t - start) / BIN_S))]
                b[0] += num_bytes
                b[1] += seconds
        out: dict[str, Any] = {"t": [start + (i + 1) * BIN_S for i in range(num_bins)]}
        for name, values in (("ttft", ttft), ("itl", itl)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = [_percentile(v, q) for v in values]
        out["tokens_per_s"] = [n / BIN_S for n in tokens]
        out["transfer_gbps"] = [b / s / 1e9 if s else None for b, s in moved]
        return out


def _binned(
    samples: Iterable[tuple[float, float]], start: float, num_bins: int
) -> list[list[float]]:
    bins: list[list[float]] = [[] for _ in range(num_bins)]
    for t, v in samples:
        if t >= start:
            bins[min(num_bins - 1, int((t - start) / BIN_S))].append(v)
    return bins


def _percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile (nearest rank) in ms; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, -(-q * len(ordered) // 100) - 1))
    return ordered[rank] * 1000.0
