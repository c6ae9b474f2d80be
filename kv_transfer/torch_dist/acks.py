"""`AckWatcher`: the torch_dist sender's thread that looks for acknowledgements.

A receiver acknowledges a transfer by setting a key in its store; reading that is a network
round trip per open transfer, which `poll` must not make (it never blocks, even when the
receiver's store stops answering). This thread makes them and hands what it finds to the
sender's `Outbox`; `poll` only reads the outbox.
"""

from __future__ import annotations

import threading

from kv_transfer.outbox import Outbox
from kv_transfer.torch_dist.channel import Channel, ack_key

ACK_POLL_S = 0.005
"""Pause between passes over the open transfers. NOTE: the engine thread used to look once per
iteration (every ~1 ms while idle, once per step while busy); 5 ms keeps the store traffic of
an idle worker lower and adds at most that to a busy one's release of its blocks."""
IDLE_WAIT_S = 0.5  # the longest sleep with nothing open; `wake` ends it at once


class AckWatcher:
    def __init__(self, outbox: Outbox, name: str, timeout_s: float) -> None:
        self._outbox = outbox
        self._timeout_s = timeout_s
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-acks-{name}", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A transfer opened: look for its acknowledgement from now on."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed.is_set():
            pending = self._outbox.undecided()
            if not pending:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            for request_id in pending:
                channel = self._outbox.channel_of(request_id)
                if isinstance(channel, Channel):
                    self._check(channel, request_id)
            self._closed.wait(ACK_POLL_S)

    def _check(self, channel: Channel, request_id: str) -> None:
        key = ack_key(channel.cid, request_id)
        try:
            acked = channel.store.check([key])
            if acked:
                channel.store.delete_key(key)
        except Exception as e:  # receiver gone (or its store stopped answering)
            self._outbox.fail(request_id, str(e))
            return
        if acked:
            self._outbox.acknowledge(request_id)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=self._timeout_s)
