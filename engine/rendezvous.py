"""`listening_store`: a `TCPStore` server that listens on the one address it is given.

c10d's own server socket ignores the host: `TCPStore(host, port, is_master=True)` listens on
every interface (IPv6 dual-stack, `[::]`), so a store meant for loopback (a tensor-parallel
group's rendezvous) or for one interface (a KV receiver's) was reachable from every network the
machine is on. Here the socket is bound to `host` first and handed to the store
(`master_listen_fd`), which then accepts on that address only.

A second effect: c10d formats every socket's peer address with `getnameinfo`, a reverse DNS
lookup (pytorch/pytorch#159007). An IPv4 listener's peers are IPv4 addresses, which the hosts
file answers for loopback; the dual-stack listener's were IPv4-mapped IPv6 addresses
(`::ffff:127.0.0.1`), which it does not, so each accepted connection asked the DNS server, and
a dropped query held the store's accept loop for the resolver's 5 s timeout.

`gloo_interface_toward`: gloo binds the interface of the machine's host name unless
`GLOO_SOCKET_IFNAME` names one, and a host name that resolves to loopback (a Debian hosts
file's `127.0.1.1`, a container's) made a rank on another machine dial 127.0.0.1 ("Gloo
connectFullMesh failed ... Connection refused"). A group that meets at a store on another
machine uses the interface this machine reaches that store by.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct

import torch.distributed as dist

__all__ = ["bound_socket", "gloo_interface_toward", "listening_store"]


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port) and listening; IPv6 when `host` is an
    IPv6 address, IPv6-only (no IPv4-mapped peers) unless `host` is `::`. Raises `OSError`
    naming the address when it cannot be bound."""
    infos = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(host != "::"))
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def listening_store(
    host: str, port: int, world_size: int | None, timeout_s: float
) -> dist.TCPStore:
    """A `TCPStore` server on `host:port` (0: a free port; read it from `.port`) that accepts
    connections on that address only. `world_size` None: any number of clients."""
    sock = bound_socket(host, port)
    bound_port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store's socket owns the descriptor from here (it closes it)
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


_SIOCGIFADDR = 0x8915


def gloo_interface_toward(host: str) -> str | None:
    """Set `GLOO_SOCKET_IFNAME` (unless already set) to the interface this machine reaches
    `host` by (the source address the kernel routes a datagram to it from; nothing is sent),
    and return it: loopback for a loopback address. None (and nothing set) when `host` does not
    resolve to IPv4, is 0.0.0.0, or no interface holds the address: gloo then picks by host
    name, as before."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    try:
        target = socket.gethostbyname(host)
        if ipaddress.ip_address(target).is_unspecified:  # 0.0.0.0: no one interface
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # a datagram socket's connect only picks the route
            local = str(probe.getsockname()[0])
    except OSError:
        return None
    name = "lo" if ipaddress.ip_address(target).is_loopback else _interface_holding(local)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def _interface_holding(address: str) -> str | None:
    """The name of the interface whose IPv4 address is `address` (SIOCGIFADDR on each)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return None
