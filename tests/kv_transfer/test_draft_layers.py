"""A transfer that carries a draft model's layers after the target's (speculative decoding
whose draft KV the prefill worker computes): on every backend the draft's blocks land bit-exact
in the draft blocks the receiver reserved, whole or layer-wise, expected or staged; with no
draft blocks reserved they are dropped; and the handshake refuses a pair that disagrees on the
draft."""

from __future__ import annotations

import os

import pytest
import torch

from duet.kv_transfer import HandshakeError, TransferStatus, chunks, create_receiver, create_sender
from duet.kv_transfer.chunks import plan_pieces
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.local import LocalHub
from duet.kv_transfer.tcp import stripes
from tests.kv_transfer.paged import caches, draft_caches, draft_layout, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(
    params=["local", "torch_dist", "torch_dist-nccl-emulated", "tcp", "tcp-striped", "nixl",
            "nixl-push"]
)  # fmt: skip
def backend(request, monkeypatch):
    if request.param == "tcp-striped":
        monkeypatch.setattr(stripes, "STRIPE_MIN_BYTES", 1)
        return "tcp"
    if request.param == "torch_dist-nccl-emulated":
        monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
        return "torch_dist"
    if request.param == "nixl-push":
        monkeypatch.setenv("DUET_KV_NIXL_MODE", "push")
        return "nixl"
    return request.param


@pytest.fixture
def pair(backend):
    """A sender over (caches, draft caches) and a receiver over fresh ones, both naming the
    draft."""
    hub = LocalHub()
    opts = {"hub": hub} if backend == "local" else {}
    dst, dst_draft = caches(seed=1), draft_caches(seed=11)
    recv = create_receiver(
        backend, dst, draft_layout(dst, dst_draft), None, dst_draft, timeout_s=10,
        **({**opts, "name": "d0"} if backend == "local" else {}),
    )  # fmt: skip
    src, src_draft = caches(), draft_caches()
    sender = create_sender(
        backend, src, draft_layout(src, src_draft), None, src_draft, name="p0", timeout_s=10,
        **opts,
    )  # fmt: skip
    yield sender, recv, (src, src_draft), (dst, dst_draft)
    sender.close()
    recv.close()


def done(receiver):
    [result] = wait_for(receiver.poll, 20, "the receiver's result")
    return result


def sent_chunks(backend, layers):
    """The messages a whole-request `send` of target and draft layers makes: local copies all
    at once, tcp sends a frame per group, torch_dist chunks each group; nixl offers every layer
    at once (pull: one offer the receiver reads; push: one write of both groups)."""
    return {"local": 1, "tcp": 2, "nixl": 1}.get(backend) or len(layers.shape.pieces(1 << 30))


def offered(receiver, request_id):
    """The receiver holds what came for `request_id` before it was expected."""
    return request_id in getattr(receiver, "_inbox", getattr(receiver, "_pending", {}))


def test_draft_layers_land_in_the_reserved_draft_blocks(pair, backend):
    sender, recv, (src, src_draft), (dst, dst_draft) = pair
    recv.expect("r1", [9, 3, 12], 10, draft_block_ids=[4, 15, 0])
    sender.send("r1", [0, 5, 7], recv.address, {"first_token": 3}, draft_block_ids=[2, 8, 1])
    result = done(recv)
    assert (result.status, result.draft, result.meta) == (
        TransferStatus.DONE,
        True,
        {"first_token": 3},
    )
    [sent] = wait_for(sender.poll, 20, "the ack")
    layers = PagedLayers.of_ids(src, [0, 5, 7], src_draft, [2, 8, 1])
    assert (sent.status, sent.num_chunks) == (TransferStatus.DONE, sent_chunks(backend, layers))
    if backend not in ("local", "nixl"):  # the draft's layers: chunks of their own
        assert sent.num_chunks >= 2
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]])
    for s, d in zip(src_draft, dst_draft, strict=True):
        assert torch.equal(d[:, [4, 15, 0]], s[:, [2, 8, 1]])
    # Without draft ids the transfer is the target's alone, on the same channel.
    before = [d.clone() for d in dst_draft]
    recv.expect("r2", [1], 10, draft_block_ids=[5])
    sender.send("r2", [2], recv.address)
    result = done(recv)
    assert (result.status, result.draft) == (TransferStatus.DONE, False)
    assert all(torch.equal(d[:, 1], s[:, 2]) for s, d in zip(src, dst, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(dst_draft, before, strict=True))


def test_draft_layers_nobody_reserved_are_dropped(pair):
    sender, recv, (src, _), (dst, dst_draft) = pair
    before = [d.clone() for d in dst_draft]
    recv.expect("r1", [9, 3], 10)
    sender.send("r1", [0, 5], recv.address, draft_block_ids=[2, 8])
    result = done(recv)
    assert (result.status, result.draft) == (TransferStatus.DONE, False)
    assert all(torch.equal(d[:, [9, 3]], s[:, [0, 5]]) for s, d in zip(src, dst, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(dst_draft, before, strict=True))


def test_draft_layers_sent_before_expect_are_staged_then_written(pair, backend):
    sender, recv, (src, src_draft), (dst, dst_draft) = pair
    sender.send("early", [1, 2], recv.address, draft_block_ids=[3, 4])
    wait_for(lambda: offered(recv, "early"), 20, "the staged arrival (nixl: the offer)")
    recv.expect("early", [6, 7], 10, draft_block_ids=[10, 11])
    assert done(recv).draft
    assert all(torch.equal(d[:, [6, 7]], s[:, [1, 2]]) for s, d in zip(src, dst, strict=True))
    for s, d in zip(src_draft, dst_draft, strict=True):
        assert torch.equal(d[:, [10, 11]], s[:, [3, 4]])


def test_layerwise_target_layers_then_the_draft_computed_before_begin(pair, backend, monkeypatch):
    """`begin` with draft ids: the draft's KV is in its caches already; the target's layers
    leave as the pass writes them, the draft's after them, then the trailer."""
    if backend == "local":
        pytest.skip("the local backend sends whole requests")
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    sender, recv, (src, src_draft), (dst, dst_draft) = pair
    final = caches(seed=5)
    for layer in src:
        layer.zero_()
    recv.expect("a", [9, 3, 12], 10, draft_block_ids=[4, 15, 0])
    assert sender.begin("a", [0, 5, 7], recv.address, draft_block_ids=[2, 8, 1])
    for layer, cache in enumerate(src):
        cache.copy_(final[layer])
        sender.layer_computed(layer)
    sender.finish("a", {"first_token": 42})
    result = done(recv)
    assert (result.status, result.draft, result.meta) == (
        TransferStatus.DONE,
        True,
        {"first_token": 42},
    )
    for f, d in zip(final, dst, strict=True):
        assert torch.equal(d[:, [9, 3, 12]], f[:, [0, 5, 7]])
    for s, d in zip(src_draft, dst_draft, strict=True):
        assert torch.equal(d[:, [4, 15, 0]], s[:, [2, 8, 1]])
    assert [r.status for r in wait_for(sender.poll, 20, "the ack")] == [TransferStatus.DONE]


def test_handshake_refuses_a_pair_that_disagrees_on_the_draft(backend):
    hub = LocalHub()
    opts = {"hub": hub} if backend == "local" else {}
    dst = caches(seed=1)
    recv = create_receiver(
        backend, dst, layout(dst), None, None, timeout_s=10,
        **({**opts, "name": "d0"} if backend == "local" else {}),
    )  # fmt: skip
    src, src_draft = caches(), draft_caches()
    sender = create_sender(
        backend, src, draft_layout(src, src_draft), None, src_draft, name="p0", timeout_s=10,
        **opts,
    )  # fmt: skip
    try:
        recv.expect("r1", [1], 10)
        with pytest.raises(HandshakeError, match="draft: sender DraftLayout"):
            sender.send("r1", [0], recv.address, draft_block_ids=[0])
    finally:
        sender.close()
        recv.close()


def test_layout_and_ids_are_checked():
    src, src_draft = caches(), draft_caches()
    with pytest.raises(ValueError, match="draft_caches: given exactly when the layout names"):
        create_sender("tcp", src, layout(src), None, src_draft, name="p0")
    with pytest.raises(ValueError, match="draft_caches: do not match the layout's draft"):
        create_sender("tcp", src, draft_layout(src, src_draft[:1]), None, src_draft, name="p0")
    with pytest.raises(ValueError, match=r"draft_block_ids: 16 is not in \[0, 16\)"):
        PagedLayers.of_ids(src, [0], src_draft, [16])
    with pytest.raises(ValueError, match="draft_block_ids: 1 blocks; the target's transfer has 2"):
        PagedLayers.of_ids(src, [0, 1], src_draft, [3])
    layout_dict = draft_layout(src, src_draft).to_dict()
    assert layout_dict["draft"] == {
        "model_id": "d",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
    }
    assert type(layout(src).from_dict(layout_dict).draft).__name__ == "DraftLayout"


def test_pieces_never_span_the_target_and_the_draft(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 100)
    groups = [(0, 3, 30), (3, 5, 15)]  # 2 blocks: layers of 60 and 30 bytes
    assert plan_pieces(groups, 2, 1 << 20) == [(0, 2, 0, 2), (2, 3, 0, 2), (3, 5, 0, 2)]
    assert plan_pieces(groups, 2, 1 << 20, whole=True) == [(0, 3, 0, 2), (3, 5, 0, 2)]
    assert plan_pieces(groups[:1], 2, 1 << 20) == [(0, 2, 0, 2), (2, 3, 0, 2)]
    # a piece of at most 30 bytes: a target layer in two, the draft a layer at a time
    assert plan_pieces(groups, 2, 30, whole=True) == [
        (0, 1, 0, 1), (0, 1, 1, 2), (1, 2, 0, 1), (1, 2, 1, 2), (2, 3, 0, 1), (2, 3, 1, 2),
        (3, 4, 0, 2), (4, 5, 0, 2),
    ]  # fmt: skip
