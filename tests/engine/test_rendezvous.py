"""The stores duet serves (a tensor-parallel group's rendezvous, a torch_dist KV receiver's)
accept connections on the address they were given, and only there."""

from __future__ import annotations

import datetime
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from duet.engine.rendezvous import bound_socket, gloo_interface_toward, listening_store
from duet.kv_transfer import create_receiver
from tests.kv_transfer.paged import caches, layout
from tests.netns import NetLab, unavailable


def refused(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


def test_a_loopback_store_serves_its_address_and_no_other():
    store = listening_store("127.0.0.1", 0, None, 10)
    client = dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    client.set("k", "v")
    assert store.get("k") == b"v"
    # 127.0.0.2 is loopback too: a store on every interface (c10d's own) would accept there.
    assert refused("127.0.0.2", store.port)


def test_an_ipv6_socket_is_ipv6_only_unless_it_is_the_wildcard():
    with bound_socket("::1", 0) as sock:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    with bound_socket("::", 0) as sock:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0


def test_an_address_in_use_is_an_error_naming_it():
    with bound_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: "):
            listening_store("127.0.0.1", port, None, 10)


def test_a_torch_dist_receiver_listens_on_its_host_only():
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    try:
        host, port = recv.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert refused("127.0.0.2", int(port))
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # its own address accepts
    finally:
        recv.close()


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_gloo_takes_the_interface_that_reaches_the_store(tmp_path, monkeypatch):
    """A group meeting on another host uses the interface routed to it (the host name may
    resolve to loopback); one meeting here uses loopback; a GLOO_SOCKET_IFNAME set is kept."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the value before is restored after
    with NetLab(["a", "b"], tmp_path) as lab, ThreadPoolExecutor(1, lab.enter_fn("a")) as on_a:

        def toward(host: str) -> tuple[str | None, str | None]:
            monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
            return on_a.submit(gloo_interface_toward, host).result(10), os.environ.get(
                "GLOO_SOCKET_IFNAME"
            )

        assert toward(lab.address("b")) == ("eth0", "eth0")
        assert toward("127.0.0.1") == ("lo", "lo")
        assert toward("no-such-host.invalid") == (None, None)  # gloo picks by host name
        assert toward("0.0.0.0") == (None, None)  # every interface: none in particular
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        assert on_a.submit(gloo_interface_toward, lab.address("b")).result(10) == "lo"
