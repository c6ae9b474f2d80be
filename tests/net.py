"""Ports for the servers tests start on loopback."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket held a moment ago (the kernel picked it).

    NOTE: the port is released before it is returned, so another process may take it first;
    prefer binding to port 0 where the code under test can report its port back."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
