"""The bounded staging pool (slots of one arena, waits for room, allocation failures), how a
transfer is cut into pieces, the inbox writing pieces as they land and giving their slots
back, and the bf16 scatter that moves 2-byte elements as int32 pairs."""

from __future__ import annotations

import threading

import pytest
import torch

from duet.kv_transfer import KVLayout, SenderConfig, TransferStatus, gather_blocks, scatter_blocks
from duet.kv_transfer.chunks import CHUNK_MIN_BYTES, layer_chunks, plan_pieces
from duet.kv_transfer.inbox import Arrival, InboxKVReceiver
from duet.kv_transfer.layers import PagedLayers, TransferShape
from duet.kv_transfer.staging import StagingError, StagingPool

CPU = torch.device("cpu")


MIB = 1 << 20


def test_pool_hands_out_disjoint_slots_first_fit_and_merges_what_comes_back():
    pool = StagingPool(CPU, MIB)
    assert pool.max_piece_bytes == MIB // 4
    a = pool.try_take((100,), torch.float32)  # 400 bytes: a 512-byte slot
    b = pool.try_take((4, 2), torch.bfloat16)  # 16 bytes: a 256-byte slot
    assert a.shape == (100,) and a.dtype == torch.float32 and a.is_contiguous()
    assert b.data_ptr() - a.data_ptr() == 512  # slots are 256-byte aligned, back to back
    assert (pool.used_bytes, pool.high_water_bytes) == (768, 768)
    pool.give(a)
    c = pool.try_take((60,), torch.float64)  # 480 bytes: the first fit is a's slot
    assert c.data_ptr() == a.data_ptr() and c.dtype == torch.float64
    rest = pool.try_take((MIB - 768,), torch.uint8)  # everything after b
    assert rest.data_ptr() - a.data_ptr() == 768
    assert pool.used_bytes == MIB and pool.try_take((1,), torch.uint8) is None  # full
    for t in (b, c, rest):
        pool.give(t)
    assert pool.used_bytes == 0 and pool._free == [(0, MIB)]  # merged back into one region
    assert pool.high_water_bytes == MIB
    whole = pool.try_take((MIB,), torch.uint8)  # so the whole pool fits one slot again
    assert whole.data_ptr() == a.data_ptr()


def test_take_waits_for_room_within_its_timeout():
    pool = StagingPool(CPU, MIB)
    held = pool.try_take((MIB,), torch.uint8)
    with pytest.raises(StagingError, match=r"no room in the KV staging pool \(1048576 bytes"):
        pool.take((8,), torch.uint8, timeout_s=0.05)
    assert pool.num_waits == 1
    gave = threading.Event()

    def give_back():
        gave.wait(10)
        pool.give(held)

    thread = threading.Thread(target=give_back)
    thread.start()
    gave.set()
    got = pool.take((8,), torch.uint8, timeout_s=10)  # woken by the give
    thread.join(10)
    assert got.data_ptr() == held.data_ptr() and pool.used_bytes == 256
    with pytest.raises(StagingError, match="larger than the KV staging pool"):
        pool.try_take((MIB + 1,), torch.uint8)


def test_a_failed_allocation_raises_and_the_next_take_allocates(monkeypatch):
    pool = StagingPool(CPU, MIB)
    allocate = pool._allocate
    calls = []

    def fail_once():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return allocate()

    monkeypatch.setattr(pool, "_allocate", fail_once)
    with pytest.raises(StagingError, match="could not allocate the 1048576-byte KV staging pool"):
        pool.try_take((8,), torch.uint8)
    assert pool.used_bytes == 0
    assert pool.try_take((8,), torch.uint8) is not None and len(calls) == 2
    pool.try_take((8,), torch.uint8)
    assert len(calls) == 2  # allocated once, kept


@pytest.mark.parametrize("value", [MIB - 1, 0, 2.0, True, (1 << 40) + 1])
def test_a_pool_size_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"^staging_bytes: must be"):
        StagingPool(CPU, value)
    with pytest.raises(ValueError, match=r"^staging_bytes: must be"):
        SenderConfig(staging_bytes=value)


def test_pieces_split_a_layer_larger_than_a_piece_into_blocks():
    # 10 blocks of 100 bytes (K and V) per layer: 1000-byte layers
    assert plan_pieces([(0, 3, 100)], 10, 1 << 20, whole=True) == [(0, 3, 0, 10)]
    assert plan_pieces([(0, 3, 100)], 10, 2000, whole=True) == [(0, 2, 0, 10), (2, 3, 0, 10)]
    # 400 bytes: 4 blocks a piece at most, so 3 pieces a layer, as equal as blocks allow
    assert plan_pieces([(0, 2, 100)], 10, 400) == [
        (0, 1, 0, 3), (0, 1, 3, 6), (0, 1, 6, 10), (1, 2, 0, 3), (1, 2, 3, 6), (1, 2, 6, 10),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"^staging_bytes: a piece may hold 99 bytes, less than"):
        plan_pieces([(0, 2, 100)], 10, 99)


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

    shape = TransferShape(3, 2, (4, 2, 8), 4)
    arrival = Arrival(shape, inbox.layout, {"first_token": 7}, count("ack"), 0.0)
    return inbox, dst, blocks, arrival, calls, count("release")


def test_inbox_writes_pieces_as_they_land_and_finishes_once_all_are_written():
    inbox, dst, blocks, arrival, calls, release = _inbox()
    inbox.deliver("r", arrival)
    inbox.expect("r", [5, 2], timeout_s=10)
    assert inbox.poll() == []
    inbox.progress(arrival, (0, 2, 0, 2), blocks[0:2].clone(), release)  # layers 0 and 1
    inbox.progress(arrival, (2, 3, 1, 2), blocks[2:3, :, 1:2].clone(), release)  # a block of 2
    assert inbox.poll() == []  # block 5 of layer 2 still on the wire
    for layer in range(2):
        assert torch.equal(dst[layer][:, [5, 2]], blocks[layer])
    assert torch.equal(dst[2][:, 2], blocks[2][:, 1]) and torch.count_nonzero(dst[2][:, 5]) == 0
    assert calls == {"ack": 0, "release": 2}  # each slot back once written
    inbox.progress(arrival, (2, 3, 0, 1), blocks[2:3, :, 0:1].clone(), release)
    [done] = inbox.poll()
    assert done.status == TransferStatus.DONE and done.meta == {"first_token": 7}
    assert torch.equal(dst[2][:, [5, 2]], blocks[2])
    assert calls == {"ack": 1, "release": 3}
    assert inbox.poll() == []


def test_inbox_abort_mid_transfer_writes_nothing_more_and_gives_every_slot_back():
    inbox, dst, blocks, arrival, calls, release = _inbox()
    inbox.expect("r", [5, 2], timeout_s=10)
    inbox.deliver("r", arrival)
    inbox.progress(arrival, (0, 1, 0, 2), blocks[0:1].clone(), release)
    assert inbox.poll() == []
    inbox.progress(arrival, (1, 2, 0, 2), blocks[1:2].clone(), release)  # landed, not written
    inbox.abort("r")
    assert [r.status for r in inbox.poll()] == [TransferStatus.ABORTED]
    assert calls == {"ack": 0, "release": 2}
    inbox.progress(arrival, (2, 3, 0, 2), blocks[2:3].clone(), release)  # after the abort
    assert calls == {"ack": 0, "release": 3}  # dropped at once
    assert inbox.poll() == []
    assert torch.equal(dst[0][:, [5, 2]], blocks[0])
    assert torch.count_nonzero(dst[1]) == 0 and torch.count_nonzero(dst[2]) == 0


def test_inbox_drops_a_late_arrival_for_an_aborted_request_on_delivery():
    inbox, dst, blocks, arrival, calls, release = _inbox()
    inbox.expect("r", [5, 2], timeout_s=10)
    inbox.abort("r")
    inbox.deliver("r", arrival)
    inbox.progress(arrival, (0, 3, 0, 2), blocks.clone(), release)
    assert calls == {"ack": 0, "release": 1}
    assert [r.status for r in inbox.poll()] == [TransferStatus.ABORTED]
    assert all(torch.count_nonzero(c) == 0 for c in dst)


def test_a_write_that_raises_fails_only_its_request(monkeypatch):
    """Out of memory in a scatter on the engine thread: that request FAILS (retryable), its
    slots go back, and the next request is written."""
    inbox, dst, blocks, arrival, calls, release = _inbox()
    inbox.expect("r", [5, 2], timeout_s=10)
    inbox.deliver("r", arrival)
    inbox.progress(arrival, (0, 3, 0, 2), blocks.clone(), release)
    scatter = PagedLayers.scatter_piece

    def fail_once(self, *args, **kwargs):
        monkeypatch.setattr(PagedLayers, "scatter_piece", scatter)
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(PagedLayers, "scatter_piece", fail_once)
    [failed] = inbox.poll()
    assert (failed.status, failed.retryable) == (TransferStatus.FAILED, True)
    assert failed.error == "writing its KV failed: injected"
    assert calls == {"ack": 0, "release": 1}
    _, _, _, again, _, _ = _inbox()
    inbox.expect("r2", [1, 3], timeout_s=10)
    inbox.deliver("r2", again)
    inbox.progress(again, (0, 3, 0, 2), blocks.clone(), release)
    assert [r.status for r in inbox.poll()] == [TransferStatus.DONE]
    assert all(torch.equal(dst[layer][:, [1, 3]], blocks[layer]) for layer in range(3))


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
