"""The KV-transfer benchmark's raw NIXL baseline: one WRITE of one contiguous buffer, over UCX,
between the benchmark's two peers (what UCX moves without duet: one descriptor, no protocol).

Each peer owns a `RawNixl`: an agent of its own (not the backend's), with one buffer of the
largest transfer's bytes allocated, touched and registered at start-up. The sender loads the
receiver's metadata once and opens the connection before any timing. A rep: the receiver arms
(`arm`, then `wait` for the write's notification, which NIXL delivers after the data); the
sender `write`s the first `nbytes` of its buffer into the receiver's and waits for the WRITE
to complete. The time is from the sender's start to the receiver seeing the notification, as
a duet transfer's is from `send` to the receiver's DONE.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np
import torch

NOTIF_POLL_S = 0.00005  # the receiver's pause between looks for the notification


def nixl_installed() -> bool:
    """Whether a NIXL Python module is importable (the baseline and the backend need one)."""
    from duet.kv_transfer.nixl.agent import NIXL_MODULES

    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a dotted name whose parent is absent
            continue
    return False


class RawNixl:
    """One peer's agent and registered buffer. Every call from one thread (the peer's)."""

    def __init__(self, name: str, nbytes: int, device: str = "cpu") -> None:
        from duet.kv_transfer.nixl.agent import load_nixl

        nixl = load_nixl()
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl.nixl_agent(f"bench-raw-{name}", config)
        # every page touched, as a cache's; on a GPU the buffer is device memory (VRAM)
        self.buffer = torch.ones(nbytes, dtype=torch.uint8, device=torch.device(device))
        cuda = self.buffer.device.type == "cuda"
        self._mem = "VRAM" if cuda else "DRAM"
        self._dev = (self.buffer.device.index or 0) if cuda else 0  # both peers: one GPU
        self._registered = self._agent.register_memory(self.buffer)
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peer: str | None = None
        self._remote_address = 0
        self._seen: set[bytes] = set()  # notifications read while waiting for another

    @property
    def address(self) -> int:
        return int(self.buffer.data_ptr())

    def connect(self, metadata: bytes, remote_address: int) -> None:
        """The sender: load the receiver's agent and open the connection (not timed)."""
        peer = self._agent.add_remote_agent(metadata)
        self._peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._remote_address = remote_address
        self._agent.make_connection(self._peer)

    def write(self, nbytes: int, tag: int, timeout_s: float) -> None:
        """The sender: WRITE `nbytes` into the receiver's buffer, notifying `tag` after the
        data; returns once the WRITE completed. TimeoutError after `timeout_s`."""
        if self._peer is None:
            raise RuntimeError("raw NIXL write before connect")
        if not 0 < nbytes <= self.buffer.nbytes:
            raise ValueError(f"nbytes: {nbytes} is not in [1, {self.buffer.nbytes}]")
        local = np.array([[self.address, nbytes, self._dev]], dtype=np.uint64)
        remote = np.array([[self._remote_address, nbytes, self._dev]], dtype=np.uint64)
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, self._mem),
            self._peer,
            str(tag).encode(),
        )
        try:
            deadline = time.monotonic() + timeout_s
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw NIXL write of {nbytes} bytes: over {timeout_s} s")
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write of {nbytes} bytes: {state}")
        finally:
            self._agent.release_xfer_handle(handle)

    def wait(self, tag: int, timeout_s: float) -> None:
        """The receiver: return once the write notifying `tag` landed; TimeoutError after
        `timeout_s`."""
        want = str(tag).encode()
        deadline = time.monotonic() + timeout_s
        while want not in self._seen:
            for messages in self._agent.get_new_notifs().values():
                self._seen.update(messages)
            if want in self._seen:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL write {tag}: no notification within {timeout_s} s")
            time.sleep(NOTIF_POLL_S)
        self._seen.discard(want)

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # the process ends right after
            pass


def raw_nixl_info(raw: RawNixl | None) -> dict[str, Any] | None:
    """What the sender needs from the receiver's `RawNixl` (None: no NIXL baseline)."""
    return None if raw is None else {"metadata": raw.metadata, "address": raw.address}
