"""Staging buffers reused across transfers, the inbox writing layers as they land, and the
bf16 scatter that moves 2-byte elements as int32 pairs."""

from __future__ import annotations

import pytest
import torch

from duet.kv_transfer import KVLayout, TransferStatus, gather_blocks, scatter_blocks
from duet.kv_transfer.chunks import CHUNK_MIN_BYTES, layer_chunks
from duet.kv_transfer.inbox import Arrival, InboxKVReceiver
from duet.kv_transfer.staging import StagingPool

CPU = torch.device("cpu")


def test_pool_reuses_the_smallest_idle_buffer_that_fits():
    pool = StagingPool(CPU, max_idle=2)
    big, small = pool.take((2, 50), torch.float32), pool.take((10,), torch.float32)
    assert big.shape == (2, 50) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() != small.data_ptr()  # both in use: never the same memory
    pool.give(big)
    pool.give(small)
    assert pool.idle_bytes == 400 + 40
    again = pool.take((4, 2), torch.bfloat16)  # 16 bytes: the 40-byte buffer fits
    assert again.data_ptr() == small.data_ptr() and again.shape == (4, 2)
    assert pool.idle_bytes == 400
    assert pool.take((200,), torch.uint8).data_ptr() == big.data_ptr()
    assert pool.take((200,), torch.uint8).data_ptr() != big.data_ptr()  # taken: a new one


def test_pool_keeps_only_the_largest_idle_buffers():
    pool = StagingPool(CPU, max_idle=2)
    buffers = [pool.take((n,), torch.uint8) for n in (8, 32, 16)]
    for b in buffers:
        pool.give(b)
    assert pool.idle_bytes == 32 + 16


def test_layer_chunks_hold_whole_layers_of_at_least_the_minimum():
    assert layer_chunks(30, CHUNK_MIN_BYTES) == [(i, i + 1) for i in range(30)]
    assert layer_chunks(30, CHUNK_MIN_BYTES * 2) == [(i, i + 1) for i in range(30)]
    assert layer_chunks(30, 24_576) == [(0, 30)]  # one small transfer: one message
    per = -(-CHUNK_MIN_BYTES // 393_216)  # layers of 384 KiB per chunk (6 at 2 MiB)
    assert per * 393_216 >= CHUNK_MIN_BYTES > (per - 1) * 393_216
    assert layer_chunks(30, 393_216) == [(i, min(i + per, 30)) for i in range(0, 30, per)]
    assert layer_chunks(32, 2 << 20) == [(i, i + 1) for i in range(32)]


class _Inbox(InboxKVReceiver):
    """The shared receiver bookkeeping on its own (a backend adds the channels)."""

    @property
    def address(self) -> str:
        return "inbox"


def _inbox():
    g = torch.Generator().manual_seed(0)
    dst = [torch.zeros(2, 8, 4, 2, 8) for _ in range(3)]
    blocks = torch.randn(3, 2, 2, 4, 2, 8, generator=g)  # [L, 2, n, BS, h, D]
    inbox = _Inbox(dst, KVLayout.of_caches("m", dst, 2))
    calls = {"ack": 0, "release": 0}

    def count(name):
        def bump():
            calls[name] += 1

        return bump

    arrival = Arrival(
        blocks.clone(),
        inbox.layout,
        {"first_token": 7},
        count("ack"),
        0.0,
        layers_ready=0,
        release=count("release"),
    )
    return inbox, dst, blocks, arrival, calls


def test_inbox_writes_layers_as_they_land_and_finishes_once_all_are_written():
    inbox, dst, blocks, arrival, calls = _inbox()
    inbox.deliver("r", arrival)
    inbox.expect("r", [5, 2], timeout_s=10)
    assert inbox.poll() == []
    inbox.progress(arrival, 2)
    assert inbox.poll() == []  # layers 0 and 1 written, layer 2 still on the wire
    for layer in range(2):
        assert torch.equal(dst[layer][:, [5, 2]], blocks[layer])
    assert torch.count_nonzero(dst[2]) == 0 and calls == {"ack": 0, "release": 0}
    inbox.progress(arrival, 3)
    [done] = inbox.poll()
    assert done.status == TransferStatus.DONE and done.meta == {"first_token": 7}
    assert torch.equal(dst[2][:, [5, 2]], blocks[2])
    assert calls == {"ack": 1, "release": 1}
    assert inbox.poll() == []


def test_inbox_abort_mid_transfer_writes_nothing_more_and_lets_go_of_the_buffer():
    inbox, dst, blocks, arrival, calls = _inbox()
    inbox.expect("r", [5, 2], timeout_s=10)
    inbox.deliver("r", arrival)
    inbox.progress(arrival, 1)
    assert inbox.poll() == []
    inbox.abort("r")
    assert [r.status for r in inbox.poll()] == [TransferStatus.ABORTED]
    assert calls == {"ack": 0, "release": 1}
    inbox.progress(arrival, 3)  # the rest lands after the abort: dropped
    assert inbox.poll() == []
    assert torch.equal(dst[0][:, [5, 2]], blocks[0])
    assert torch.count_nonzero(dst[1]) == 0 and torch.count_nonzero(dst[2]) == 0
    assert calls == {"ack": 0, "release": 1}


def test_inbox_drops_a_late_arrival_for_an_aborted_request_on_delivery():
    inbox, dst, _, arrival, calls = _inbox()
    inbox.expect("r", [5, 2], timeout_s=10)
    inbox.abort("r")
    inbox.deliver("r", arrival)
    assert calls == {"ack": 0, "release": 1}
    inbox.progress(arrival, 3)
    assert [r.status for r in inbox.poll()] == [TransferStatus.ABORTED]
    assert all(torch.count_nonzero(c) == 0 for c in dst)


@pytest.mark.parametrize(("dst_heads", "head_range"), [(2, None), (4, (2, 4))])
def test_bf16_scatter_moves_exact_bits_also_into_a_head_slice(dst_heads, head_range):
    # NaNs with payloads, a negative NaN and a denormal: any float conversion would alter them
    bits = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001], dtype=torch.int16).repeat(2 * 3 * 4 * 2 * 2)
    src = [bits.view(torch.bfloat16).view(2, 3, 4, 2, 8)]  # [2, NB, BS, h, D]
    dst = [torch.zeros(2, 5, 4, dst_heads, 8, dtype=torch.bfloat16)]
    blocks = gather_blocks(src, torch.tensor([2, 0]))
    scatter_blocks(dst, torch.tensor([4, 1]), blocks, head_range=head_range)
    start, end = head_range or (0, 2)
    written = dst[0][:, [4, 1], :, start:end].view(torch.int16)
    assert torch.equal(written, src[0][:, [2, 0]].view(torch.int16))
    untouched = [h for h in range(dst_heads) if not start <= h < end]
    assert torch.count_nonzero(dst[0][:, :, :, untouched].view(torch.int16)) == 0
    assert torch.count_nonzero(dst[0][:, [0, 2, 3]].view(torch.int16)) == 0
