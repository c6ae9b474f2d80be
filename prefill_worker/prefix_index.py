"""`PrefixCacheIndex`: which block hashes a prefill worker's prefix cache holds, as a
sequence of events the router can follow incrementally.

The engine thread `apply`s the block pool's events after every step; `since` (any thread)
answers "what changed after event N": the events, or a full snapshot when they are no longer
kept (the router was away too long, or is new). The router keeps one set per worker and
routes a prompt to the worker holding its longest prefix of blocks.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from duet.engine.block_pool import BlockHash


@dataclass(frozen=True)
class PrefixCacheDelta:
    last_event: int  # sequence number of the newest event included
    snapshot: bool  # True: `stored` is the whole cache, `removed` is empty
    stored: list[BlockHash]
    removed: list[BlockHash]


class PrefixCacheIndex:
    def __init__(self, max_events: int = 65536) -> None:
        self._lock = threading.Lock()
        self._cached: set[BlockHash] = set()
        self._events: deque[tuple[int, bool, BlockHash]] = deque(maxlen=max_events)
        self._last = 0

    def apply(self, events: list[tuple[bool, BlockHash]]) -> None:
        """Record the pool's events (stored?, hash), in order."""
        if not events:
            return
        with self._lock:
            for stored, block_hash in events:
                self._last += 1
                self._events.append((self._last, stored, block_hash))
                if stored:
                    self._cached.add(block_hash)
                else:
                    self._cached.discard(block_hash)

    def since(self, event: int) -> PrefixCacheDelta:
        with self._lock:
            oldest = self._events[0][0] if self._events else self._last + 1
            if event <= 0 or event + 1 < oldest or event > self._last:
                return PrefixCacheDelta(self._last, True, list(self._cached), [])
            stored: list[BlockHash] = []
            removed: list[BlockHash] = []
            for seq, is_stored, block_hash in self._events:
                if seq > event:
                    (stored if is_stored else removed).append(block_hash)
            return PrefixCacheDelta(self._last, False, stored, removed)
