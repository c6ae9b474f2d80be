"""`StoreRelay`: the torch_dist receiver's store round trips, on a thread of their own.

The receiver acknowledges a transfer by setting a key in its store, and a layer-wise sender's
trailer (the first token) arrives under another key. Both are round trips (to the receiver's
own store, but through its server thread and a socket) that the engine thread's `poll` must
not make; this thread makes them: it writes the acknowledgements `poll` queues and, while
trailers are awaited, looks for them every `POLL_S`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from duet.kv_transfer.torch_dist.channel import fetch_json

logger = logging.getLogger(__name__)

POLL_S = 0.005  # pause between looks for awaited trailers
IDLE_WAIT_S = 0.5  # the longest sleep with nothing to do; new work ends it at once


@dataclass
class Trailer:
    """A layer-wise transfer's metadata, set by the relay's thread once it came."""

    meta: dict[str, Any] | None = None


class StoreRelay:
    def __init__(self, name: str, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._acks: list[tuple[dist.Store, str]] = []
        self._trailers: dict[str, tuple[dist.Store, Trailer]] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-relay-{name}", daemon=True)
        self._thread.start()

    def acknowledge(self, store: dist.Store, key: str) -> None:
        """Set `key` in `store` soon (never blocks)."""
        with self._lock:
            self._acks.append((store, key))
        self._wake.set()

    def await_trailer(self, store: dist.Store, key: str) -> Trailer:
        """Look for the JSON object under `key` until it comes (deleted once read) or `forget`."""
        trailer = Trailer()
        with self._lock:
            self._trailers[key] = (store, trailer)
        self._wake.set()
        return trailer

    def forget(self, key: str) -> None:
        """Stop looking for `key` (its transfer left the inbox)."""
        with self._lock:
            self._trailers.pop(key, None)

    def _loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                acks, self._acks = self._acks, []
                trailers = list(self._trailers.items())
            for store, key in acks:
                try:
                    store.set(key, "done")
                except Exception as e:  # the sender's lease ends the transfer there
                    logger.warning("could not acknowledge %s: %s", key, e)
            for key, (store, trailer) in trailers:
                meta = fetch_json(store, key)
                if meta is not None:
                    trailer.meta = meta
                    self.forget(key)
            with self._lock:
                waiting = bool(self._trailers)
            self._wake.wait(POLL_S if waiting else IDLE_WAIT_S)
            self._wake.clear()  # the top of the loop rereads what is queued

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=self._timeout_s)
