"""Ports for the servers tests start on loopback.

A port the kernel picks (bind to 0) comes from its ephemeral range, the range every outgoing
connection and every server that binds port 0 draws from too: Ray's raylets and object
managers, gRPC servers, each client socket of a parallel test. Between `free_port` returning
such a port and a subprocess binding it (seconds of imports later), any of those may take it,
and the server exits with "address already in use" (a full `make test` lost `duet serve` to
this once). So tests' ports come from below the ephemeral range and above Ray's worker ports
(10002-19999), each pytest-xdist worker from a band of its own: nothing else on the machine
draws from there by chance, and two workers never pick the same port."""

from __future__ import annotations

import itertools
import os
import socket

_LOW, _BAND = 20000, 3000  # worker gwN draws from [_LOW + N*_BAND, _LOW + (N+1)*_BAND)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _band() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = _LOW + n * _BAND
    return range(start, min(start + _BAND, _ephemeral_low()))


_CANDIDATES = _band()
# start where this process's id points, so a second pytest run soon after does not walk the
# ports the first left in TIME_WAIT
_NEXT = itertools.count(os.getpid() % max(1, len(_CANDIDATES)))


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing held a moment ago, from this worker's band.

    NOTE: the port is released before it is returned; prefer binding to port 0 where the code
    under test can report its port back."""
    if len(_CANDIDATES) < 100:  # the ephemeral range reaches into the bands: the kernel picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(len(_CANDIDATES)):
        port = _CANDIDATES[next(_NEXT) % len(_CANDIDATES)]
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {_CANDIDATES}")
