"""Block gather/scatter, handshakes, and the in-process `local` backend."""

from __future__ import annotations

import time

import pytest
import torch

from duet.kv_transfer import (
    HandshakeError,
    KVLayout,
    TransferStatus,
    check_compatible,
    create_receiver,
    create_sender,
    gather_blocks,
    scatter_blocks,
)
from duet.kv_transfer import blocks as blocks_module
from duet.kv_transfer.local import LocalHub


def caches(num_layers=3, num_blocks=12, block_size=4, heads=4, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, num_blocks, block_size, heads, dim, generator=g).to(dtype)
        for _ in range(num_layers)
    ]


def layout(kv, heads=4, tp_size=1, tp_rank=0, **over):
    return KVLayout.of_caches(over.pop("model_id", "m"), kv, heads, tp_size, tp_rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_round_trip_is_bit_exact(dtype):
    src, dst = caches(dtype=dtype), caches(dtype=dtype, seed=1)
    ids_src = torch.tensor([7, 2, 9, 0])
    ids_dst = torch.tensor([1, 11, 3, 5])
    blocks = gather_blocks(src, ids_src)
    assert blocks.shape == (3, 2, 4, 4, 4, 8) and blocks.is_contiguous()
    untouched = [c.clone() for c in dst]
    scatter_blocks(dst, ids_dst, blocks)
    for s, d, u in zip(src, dst, untouched, strict=True):
        assert torch.equal(d[:, ids_dst], s[:, ids_src])
        others = [i for i in range(12) if i not in ids_dst.tolist()]
        assert torch.equal(d[:, others], u[:, others])  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_row_copies_equal_the_torch_path(dtype):
    """scatter_blocks takes the C++ row copies on CPU; index_copy_ is the reference."""
    src, dst = caches(dtype=dtype), caches(dtype=dtype, seed=1)
    reference = [c.clone() for c in dst]
    ids = torch.tensor([10, 4, 0, 11, 6])
    blocks = gather_blocks(src, torch.tensor([1, 2, 3, 4, 5]))
    assert blocks_module._scatter_rows(dst, ids, blocks)  # the fast path ran
    for layer, cache in enumerate(reference):
        cache.index_copy_(1, ids, blocks[layer])
    for got, want in zip(dst, reference, strict=True):
        assert torch.equal(got, want)


def test_two_sender_shards_reassemble_heads():
    full = caches(heads=4)
    ids = torch.tensor([3, 5])
    shards = [
        [c[:, :, :, 0:2].contiguous() for c in full],
        [c[:, :, :, 2:4].contiguous() for c in full],
    ]
    dst = [torch.zeros_like(c) for c in full]
    scatter_blocks(dst, torch.tensor([0, 1]), gather_blocks(shards[0], ids), head_range=(0, 2))
    scatter_blocks(dst, torch.tensor([0, 1]), gather_blocks(shards[1], ids), head_range=(2, 4))
    for f, d in zip(full, dst, strict=True):
        assert torch.equal(d[:, [0, 1]], f[:, ids])


def test_handshake_refuses_mismatch_naming_fields():
    kv = caches()
    ok = layout(kv)
    check_compatible(ok, layout(kv, tp_size=2, tp_rank=1))  # TP may differ
    bad = KVLayout(**{**ok.to_dict(), "dtype": "bfloat16", "block_size": 16})
    with pytest.raises(HandshakeError) as info:
        check_compatible(ok, bad)
    msg = str(info.value)
    assert "dtype: sender 'float32' != receiver 'bfloat16'" in msg
    assert "block_size: sender 4 != receiver 16" in msg


def make_pair(tp_size=1, heads=4):
    hub = LocalHub()
    src, dst = caches(heads=heads // tp_size), caches(heads=heads, seed=1)
    sender = create_sender("local", hub=hub, kv_caches=src, layout=layout(src, heads, tp_size, 0))
    receiver = create_receiver(
        "local", hub=hub, name="decode-0", kv_caches=dst, layout=layout(dst, heads)
    )
    return sender, receiver, src, dst


def test_local_transfer_done_on_both_sides():
    sender, receiver, src, dst = make_pair()
    receiver.expect("r1", [4, 6], timeout_s=5)
    sender.send("r1", [1, 2], "decode-0")
    assert sender.poll() == []  # not acknowledged before the receiver scattered
    [result] = receiver.poll()
    assert result.status == TransferStatus.DONE
    assert [r.status for r in sender.poll()] == [TransferStatus.DONE]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [4, 6]], s[:, [1, 2]])


def test_heterogeneous_tp_shards_complete_one_request():
    hub = LocalHub()
    full, dst = caches(heads=4), caches(heads=4, seed=1)
    senders = []
    for rank in range(2):
        shard = [c[:, :, :, 2 * rank : 2 * rank + 2].contiguous() for c in full]
        senders.append(
            create_sender("local", hub=hub, kv_caches=shard, layout=layout(shard, 4, 2, rank))
        )
    receiver = create_receiver("local", hub=hub, name="d", kv_caches=dst, layout=layout(dst))
    receiver.expect("r1", [0, 9], timeout_s=5)
    senders[1].send("r1", [3, 4], "d", meta={"first_token": 7, "rank": 1})
    assert receiver.poll() == []  # half the heads: not done
    assert senders[1].poll() == []
    senders[0].send("r1", [3, 4], "d", meta={"first_token": 7, "rank": 0})
    [result] = receiver.poll()
    assert result.status == TransferStatus.DONE
    assert result.meta == {"first_token": 7, "rank": 0}  # the lowest rank's
    for f, d in zip(full, dst, strict=True):
        assert torch.equal(d[:, [0, 9]], f[:, [3, 4]])
    assert [r.status for s in senders for r in s.poll()] == [TransferStatus.DONE] * 2


def test_arrival_before_expect_is_kept_and_meta_delivered():
    sender, receiver, src, dst = make_pair()
    sender.send("r1", [5], "decode-0", meta={"first_token": 3})
    assert receiver.poll() == []
    receiver.expect("r1", [2], timeout_s=5)
    [result] = receiver.poll()
    assert (result.status, result.meta) == (TransferStatus.DONE, {"first_token": 3})
    assert all(torch.equal(d[:, 2], s[:, 5]) for s, d in zip(src, dst, strict=True))


def test_late_data_of_aborted_request_is_dropped():
    sender, receiver, _, dst = make_pair()
    before = [c.clone() for c in dst]
    receiver.expect("r1", [4], timeout_s=5)
    receiver.abort("r1")
    sender.send("r1", [1], "decode-0")
    receiver.expect("r2", [5], timeout_s=0.05)
    time.sleep(0.1)
    assert [r.status for r in receiver.poll()] == [TransferStatus.ABORTED, TransferStatus.FAILED]
    assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))


def test_abort_before_delivery_writes_nothing():
    sender, receiver, _, dst = make_pair()
    before = [c.clone() for c in dst]
    receiver.expect("r1", [4], timeout_s=5)
    sender.send("r1", [1], "decode-0")
    sender.abort("r1")
    assert [r.status for r in sender.poll()] == [TransferStatus.ABORTED]
    receiver.abort("r1")
    assert [r.status for r in receiver.poll()] == [TransferStatus.ABORTED]
    assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))


def test_receiver_times_out_retryable():
    _, receiver, _, _ = make_pair()
    receiver.expect("lost", [1], timeout_s=0.05)
    assert receiver.poll() == []
    time.sleep(0.1)
    [result] = receiver.poll()
    assert result.status == TransferStatus.FAILED and result.retryable


def test_unknown_destination_and_backend():
    sender, _, _, _ = make_pair()
    sender.send("r1", [1], "nowhere")
    [result] = sender.poll()
    assert result.status == TransferStatus.FAILED and result.retryable and "nowhere" in result.error
    with pytest.raises(
        ValueError,
        match="kv_backend: unknown 'rdma'; available: auto, local, nixl, tcp, torch_dist",
    ):
        create_sender("rdma", kv_caches=sender.kv_caches, layout=sender.layout)
