"""torch_dist's own staging: layer chunks through buffers reused from its pool. (What every
inter-process backend does is in test_channels.py.)"""

from __future__ import annotations

import os

import torch

from kv_transfer import TransferStatus, chunks, create_receiver, create_sender
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def test_layer_by_layer_chunks_land_bit_exact_through_reused_buffers(monkeypatch):
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    try:
        _check_chunks(recv, dst, monkeypatch)
    finally:
        recv.close()


def _check_chunks(recv, dst, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    src = caches()
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    nbytes = 3 * 2 * 3 * 4 * 4 * 8 * 4  # [L, 2, n, BS, H, D] fp32
    for attempt, (src_ids, dst_ids) in enumerate([([0, 5, 7], [9, 3, 12]), ([1, 2], [4, 6])]):
        recv.expect(f"r{attempt}", dst_ids, timeout_s=10)
        sender.send(f"r{attempt}", src_ids, recv.address)
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
        assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, dst_ids], s[:, src_ids])
        # Both sides staged the transfers in one buffer, reused the second time.
        assert sender._staging.idle_bytes == nbytes
        assert wait_for(lambda: recv._staging.idle_bytes, 20, "the staging buffer back") == nbytes
    sender.close()
