"""`Stripes`: a tcp channel's connections, and a payload cut across them."""

from __future__ import annotations

import socket
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from duet.kv_transfer import sockio
from duet.kv_transfer.tcp.framing import shutdown

MAX_STRIPES = 16
STRIPE_MIN_BYTES = 4 << 20
"""A payload is striped only where each connection gets at least this much: below it the
helper threads' hand-off costs more than a second stream saves."""


class Stripes:
    """A channel's connections. The first carries every frame and the first share of a
    payload; a large payload is cut into equal shares of bytes (`sockio.split_iovecs`), one per
    connection, moved at once by helper threads. One TCP stream on loopback leaves cores idle
    while each side waits on the other's copies; parallel streams (as NCCL's socket transport
    opens) keep both busy."""

    def __init__(self, first: socket.socket, name: str) -> None:
        self.socks = [first]
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def add(self, sock: socket.socket) -> None:
        self.socks.append(sock)
        if self._pool is None:  # starts a thread per share moving at once, no more
            self._pool = ThreadPoolExecutor(MAX_STRIPES - 1, thread_name_prefix=self.name)

    def count(self, nbytes: int) -> int:
        """How many connections a payload of `nbytes` goes over."""
        return max(1, min(len(self.socks), nbytes // STRIPE_MIN_BYTES))

    def move(self, iov: torch.Tensor, send: bool, stripes: int, head: bytes = b"") -> None:
        """Send (or receive) the bytes `iov` points at over the first `stripes` connections,
        `head` first on the first one. Returns once every share has moved; the first error of
        any share shuts every connection down (so no share waits out its timeout) and is raised.
        The helpers' waits end: each socket operation gives up after its timeout without
        progress, and a shut-down socket fails at once."""
        parts = sockio.split_iovecs(iov, stripes) if stripes > 1 else [iov]
        move = sockio.send_iovecs if send else sockio.recv_iovecs
        helpers: list[Future[None]] = []
        for sock, part in zip(self.socks[1:stripes], parts[1:], strict=True):
            assert self._pool is not None
            helpers.append(self._pool.submit(move, sock, part))
            helpers[-1].add_done_callback(self._on_helper_done)
        error: BaseException | None = None
        try:
            if send:
                sockio.send_iovecs(self.socks[0], parts[0], head=head)
            else:
                sockio.recv_iovecs(self.socks[0], parts[0])
        except BaseException as e:
            error = e
            self.shutdown()
        for helper in helpers:
            error = error or helper.exception()  # waits for it
        if error is not None:
            raise error

    def _on_helper_done(self, helper: Future[None]) -> None:
        if helper.exception() is not None:
            self.shutdown()

    def shutdown(self) -> None:
        for sock in self.socks:
            shutdown(sock)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for sock in self.socks:
            sock.close()
