"""`AckWatcher`: the torch_dist sender's threads that look for acknowledgements.

A receiver acknowledges a transfer by setting a key in its store; reading that is a network
round trip per open transfer, which `poll` must not make (it never blocks, even when the
receiver's store stops answering). A thread per channel with open transfers makes them and
hands what it finds to the sender's `Outbox`; `poll` only reads the outbox. One thread per
channel, so a receiver whose store stalls holds up only its own transfers' acknowledgements
(its lease or timeout ends them); a thread ends once its channel has nothing open.
"""

from __future__ import annotations

import threading

from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.torch_dist.channel import Channel, ack_key

ACK_POLL_S = 0.005
"""Pause between passes over a channel's open transfers. NOTE: the engine thread used to look
once per iteration (every ~1 ms while idle, once per step while busy); 5 ms keeps the store
traffic of an idle worker lower and adds at most that to a busy one's release of its blocks."""


class AckWatcher:
    def __init__(self, outbox: Outbox, name: str, timeout_s: float) -> None:
        self._outbox = outbox
        self._name = name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}  # channel id -> its watcher
        self._closed = threading.Event()

    def watch(self, channel: Channel) -> None:
        """A transfer opened on `channel` (already in the outbox): look for its acknowledgement."""
        with self._lock:
            if self._closed.is_set() or channel.cid in self._threads:
                return
            thread = threading.Thread(
                target=self._loop, args=(channel,), name=f"kv-acks-{self._name}", daemon=True
            )
            self._threads[channel.cid] = thread
        thread.start()

    def _loop(self, channel: Channel) -> None:
        while not self._closed.is_set():
            with self._lock:  # atomic with `watch`: a transfer opened now finds no thread
                pending = self._outbox.undecided(channel)
                if not pending:
                    del self._threads[channel.cid]
                    return
            for request_id in pending:
                self._check(channel, request_id)
            self._closed.wait(ACK_POLL_S)

    def _check(self, channel: Channel, request_id: str) -> None:
        key = ack_key(channel.cid, request_id)
        try:
            acked = channel.ack_store.check([key])
            if acked:
                channel.ack_store.delete_key(key)
        except Exception as e:  # receiver gone (or its store stopped answering)
            self._outbox.fail(request_id, str(e))
            return
        if acked:
            self._outbox.acknowledge(request_id)

    def close(self) -> None:
        """Stop the threads; one blocked on a stalled store is left behind (a daemon) after
        `timeout_s`."""
        self._closed.set()
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=self._timeout_s)
