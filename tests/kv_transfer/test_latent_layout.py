"""Multi-head latent attention's KV in transfer (issue 44): a layer's cache is one plane of
compressed entries (kv_lora_rank + qk_rope_head_dim values per token); it moves bit-exact over
every backend, a transfer's bytes are the latent layout's size (a dense model of the same
hidden size moves several times more), and the handshake refuses a dense side facing an MLA
one, naming both."""

from __future__ import annotations

import os

import pytest
import torch

from duet.engine.kv_cache_spec import kv_cache_spec
from duet.engine.model import ModelArchConfig
from duet.kv_transfer import (
    HandshakeError,
    KVLayout,
    TransferStatus,
    check_compatible,
    create_receiver,
    create_sender,
)
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.layout import head_route, num_senders
from tests.conftest import ARCH_CONFIGS
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ENTRY = 48 + 16  # the tiny DeepSeek models' kv_lora_rank + qk_rope_head_dim


def latent_caches(num_blocks: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """3 layers of `[1, num_blocks, 4, 1, ENTRY]`, as a DeepSeek model's runner holds them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, num_blocks, 4, 1, ENTRY, generator=g) for _ in range(3)]


def latent_layout(kv: list[torch.Tensor]) -> KVLayout:
    return KVLayout.of_caches("m", kv, 1)


@pytest.mark.parametrize("backend", ["tcp", "torch_dist", "nixl"])
def test_latent_entries_move_bit_exact(backend):
    dst, src = latent_caches(seed=1), latent_caches()
    before = [c.clone() for c in dst]
    assert latent_layout(src).num_planes == 1
    recv = create_receiver(backend, kv_caches=dst, layout=latent_layout(dst), timeout_s=10)
    sender = create_sender(
        backend, kv_caches=src, layout=latent_layout(src), name="p0", timeout_s=10
    )
    try:
        recv.expect("r1", [9, 3, 12], timeout_s=10)
        sender.send("r1", [0, 5, 7], recv.address)
        [done] = wait_for(recv.poll, 20, "recv.poll")
        assert done.status == TransferStatus.DONE
        [acked] = wait_for(sender.poll, 20, "sender.poll")
        assert acked.status == TransferStatus.DONE
        for s, d, b in zip(src, dst, before, strict=True):
            assert torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]])
            assert torch.equal(d[:, [0, 1, 15]], b[:, [0, 1, 15]])  # nothing else written
    finally:
        sender.close()
        recv.close()


def _arch(name: str, **overrides) -> ModelArchConfig:
    spec = {**ARCH_CONFIGS[name], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, **overrides}  # fmt: skip
    return ModelArchConfig.from_hf_config(spec)


def _moved_bytes(kv: list[torch.Tensor], block_ids: list[int]) -> tuple[int, int]:
    """(the bytes of a transfer's pieces, the bytes of the tcp backend's iovecs over them)."""
    paged = PagedLayers.of_ids(kv, block_ids)
    shape = paged.shape
    pieces = shape.pieces(1 << 30)
    iov = sum(int(paged.piece_iovecs(p)[:, 1].sum()) for p in pieces)
    return sum(shape.piece_nbytes(p) for p in pieces), iov


def test_transfer_bytes_are_the_latent_layouts_size():
    """3 blocks of 16 tokens of a 3-layer model in bf16: the MLA model moves 3 x 3 x 16 x 64
    values (its entries), a Llama of the same hidden size, heads and layers moves K and V of
    4 heads of 32 (256 values a token and layer): 4x more. At DeepSeek-V3's real shapes the
    entry is 576 values (K and V of its 128 heads: 128 x (192 + 128) = 40,960)."""
    deepseek = _arch("deepseek_v3", num_hidden_layers=3)
    llama = _arch("llama", num_hidden_layers=3, num_key_value_heads=4)
    ids = [0, 5, 7]
    moved = {}
    for name, arch in (("mla", deepseek), ("dense", llama)):
        spec = kv_cache_spec(arch, arch.num_key_value_heads)
        kv = [torch.zeros(spec.shape(16, 16), dtype=torch.bfloat16) for _ in range(3)]
        nbytes, iov_bytes = _moved_bytes(kv, ids)
        assert nbytes == iov_bytes == len(ids) * spec.bytes_per_block(3, 16, torch.bfloat16)
        moved[name] = nbytes
    assert moved["mla"] == 3 * 3 * 16 * ENTRY * 2
    assert moved["dense"] == 3 * 3 * 16 * 2 * 4 * 32 * 2
    assert moved["dense"] == 4 * moved["mla"]
    v3 = ModelArchConfig.from_hf_config(
        {
            **ARCH_CONFIGS["deepseek_v3"],
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 128,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_group": 8,
            "topk_group": 4,
        }
    )
    assert kv_cache_spec(v3, 1).values_per_token() == 576


def test_handshake_refuses_a_dense_side_facing_an_mla_one():
    dense, latent = layout(caches()), latent_layout(latent_caches())
    for sender, receiver in ((dense, latent), (latent, dense)):
        with pytest.raises(HandshakeError, match="cannot exchange KV") as info:
            check_compatible(sender, receiver)
        assert "num_planes 2" in str(info.value) and "num_planes 1" in str(info.value)


@pytest.mark.parametrize("backend", ["tcp", "torch_dist"])
def test_a_dense_sender_is_refused_by_an_mla_receiver_over_the_wire(backend):
    dst = latent_caches(seed=1)
    before = [c.clone() for c in dst]
    recv = create_receiver(backend, kv_caches=dst, layout=latent_layout(dst), timeout_s=10)
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    try:
        with pytest.raises(HandshakeError, match="multi-head latent attention"):
            sender.send("r1", [0], recv.address)
        assert recv.poll() == [] and sender.poll() == []
        assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))
    finally:
        sender.close()
        recv.close()


def test_a_tensor_parallel_mla_group_ships_its_replicated_entries_from_one_rank():
    """With heads sharded every rank of a TP group caches the whole entries: rank 0 ships them
    (rank 1 caches the same "head", `shipped_range`), to every rank of a TP decode group."""
    kv = latent_caches()
    senders = [KVLayout.of_caches("m", kv, 1, 2, r) for r in range(2)]
    receivers = [KVLayout.of_caches("m", kv, 1, 2, r) for r in range(2)]
    assert [s.shipped_range for s in senders] == [(0, 1), (0, 0)]
    for receiver in [*receivers, latent_layout(kv)]:
        assert num_senders(senders[0], receiver) == 1
        route = head_route(senders[0], receiver)
        assert route is not None and route.src_whole and route.dst_whole
        assert head_route(senders[1], receiver) is None
