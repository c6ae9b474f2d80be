"""The tcp backend's wire: frames (a 4-byte big-endian length and a JSON header), reading
them, and the socket settings and waits both sides share."""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from typing import Any

from duet.kv_transfer import sockio

LENGTH = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
TICK_S = 0.5  # how often idle threads look at their stop flag


def frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return LENGTH.pack(len(body)) + body


def read_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n
    return bytes(buf)


def read_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = LENGTH.unpack(read_exact(sock, LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ConnectionError(f"frame header of {length} bytes: not a duet KV peer")
    header: dict[str, Any] = json.loads(read_exact(sock, length))
    return header


def take_frames(buf: bytearray) -> list[dict[str, Any]]:
    """The whole frames at the start of `buf`, removed from it (a partial one stays)."""
    headers = []
    while len(buf) >= LENGTH.size:
        (length,) = LENGTH.unpack_from(buf)
        if len(buf) < LENGTH.size + length:
            break
        headers.append(json.loads(bytes(buf[LENGTH.size : LENGTH.size + length])))
        del buf[: LENGTH.size + length]
    return headers


def wait_readable(sock: socket.socket, stop: threading.Event, timeout_s: float | None) -> bool:
    """Block until `sock` has data (True), `stop` is set or `timeout_s` passed (False)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        tick = TICK_S if deadline is None else min(TICK_S, deadline - time.monotonic())
        if tick <= 0:
            return False
        readable, _, _ = select.select([sock], [], [], tick)
        if readable:
            return True
    return False


def readable(sock: socket.socket) -> bool:
    """Data (or the peer's close) is waiting; never blocks. False for a closed socket."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True  # closed: the recv reports it
    return bool(ready)


def shutdown(sock: socket.socket) -> None:
    """End the connection both ways: blocked sends and receives on it return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already down


def configure(sock: socket.socket, timeout_s: float) -> None:
    sock.settimeout(None)  # blocking descriptor; the kernel enforces the timeouts
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sockio.set_timeouts(sock, timeout_s)


def split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)
