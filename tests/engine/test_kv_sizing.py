"""KV pool sizing with faked GPU memory (CPU only): transfer staging, NCCL communicators and
the CUDA-graph pool are left out of the pool, and no pool outgrows 32-bit kernel offsets."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from duet.decode_worker.config import DecodeWorkerConfig
from duet.engine import kv_sizing
from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError
from duet.engine.kv_cache_spec import INT32_MAX, KVCacheSpec
from duet.engine.kv_sizing import (
    DraftSizing,
    GpuMemory,
    graph_pool_bytes,
    piecewise_pool_bytes,
    plan_gpu_kv_blocks,
    size_kv_pool,
)
from duet.engine.model.llama import Attention
from duet.engine.parallel import SINGLE, head_shard
from duet.kv_transfer.staging import DEFAULT_STAGING_BYTES, NCCL_COMM_BYTES
from duet.prefill_worker.config import PrefillWorkerConfig

GIB = 1 << 30
MIB = 1 << 20
CUDA = torch.device("cuda", 0)  # only passed along: the measurement is faked
# Llama-3.1-8B's KV: 32 layers, 8 KV heads of 128, bf16, 16-token blocks: 2 MiB a block.
LLAMA_8B_BLOCK = KVCacheSpec(2, 8, 128).bytes_per_block(32, 16, torch.bfloat16)
H100 = GpuMemory(
    total_bytes=80 * GIB,
    others_bytes=1 * GIB,
    weights_bytes=15 * GIB,
    activation_bytes=2 * GIB,
    num_warmup_tokens=2048,
)


def fake_model(layers: int, num_kv_heads: int, head_dim: int, num_heads: int) -> SimpleNamespace:
    config = SimpleNamespace(
        num_hidden_layers=layers, head_dim=head_dim, num_attention_heads=num_heads, moe=None
    )
    heads = head_shard(num_heads, num_kv_heads, 1, 0)
    spec = KVCacheSpec(2, num_kv_heads, head_dim)
    return SimpleNamespace(
        config=config, num_kv_heads=num_kv_heads, tp=SINGLE, heads=heads, num_layers=layers,
        kv_spec=spec, modules=lambda: iter(()),  # a dense model: no sparse blocks
        layers=[SimpleNamespace(self_attn=Attention.__new__(Attention))],
    )  # fmt: skip


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch):
    """Replace the warm-up measurement with `memory` (set the returned box's item)."""
    box: list[GpuMemory] = [H100]
    monkeypatch.setattr(kv_sizing, "measure_gpu_memory", lambda *a: box[0])
    return box


def test_plan_counts_every_consumer() -> None:
    assert LLAMA_8B_BLOCK == 2 * MIB
    budget = int(80 * GIB * 0.9) - (1 + 15 + 2) * GIB  # 54 GiB
    assert plan_gpu_kv_blocks(H100, 0.9, LLAMA_8B_BLOCK, {}) == budget // (2 * MIB)
    reserved = {"kv_staging": 8 * GIB, "nccl": 1 * GIB, "cuda_graphs": 512 * MIB}
    assert plan_gpu_kv_blocks(H100, 0.9, LLAMA_8B_BLOCK, reserved) == (budget - int(9.5 * GIB)) // (
        2 * MIB
    )


def test_plan_with_no_room_names_every_term() -> None:
    with pytest.raises(InvalidInputError) as info:
        plan_gpu_kv_blocks(H100, 0.25, LLAMA_8B_BLOCK, {"kv_staging": 8 * GIB})
    assert info.value.field == "gpu_memory_utilization"
    message = str(info.value)
    for term in ("weights take 15.00 GiB", "activations 2.00 GiB", "kv_staging 8.00 GiB"):
        assert term in message


def test_worker_configs_reserve_the_staging_pool_and_nccl() -> None:
    # The pool bounds staging whatever the transfers' lengths: no max_model_len term.
    want = {"kv_staging": DEFAULT_STAGING_BYTES, "nccl": 4 * NCCL_COMM_BYTES}
    for config_cls in (PrefillWorkerConfig, DecodeWorkerConfig):
        assert config_cls().device_reservations(LLAMA_8B_BLOCK, 32768) == want
        assert config_cls().device_reservations(LLAMA_8B_BLOCK, 131072) == want
        assert config_cls(kv_backend="local").device_reservations(LLAMA_8B_BLOCK, 32768) == {}
        assert config_cls(kv_backend="nixl").device_reservations(LLAMA_8B_BLOCK, 32768) == {}
        small = config_cls(kv_staging_bytes=64 * MIB, kv_nccl_peers=1)
        assert small.device_reservations(LLAMA_8B_BLOCK, 32768) == {
            "kv_staging": 64 * MIB,
            "nccl": NCCL_COMM_BYTES,
        }
    assert EngineConfig().device_reservations(LLAMA_8B_BLOCK, 32768) == {}
    for bad in (MIB - 1, 0, 1.5):
        with pytest.raises(InvalidInputError) as info:
            PrefillWorkerConfig(kv_staging_bytes=bad)
        assert info.value.field == "kv_staging_bytes"
        assert "1 MiB to 1 TiB" in str(info.value) or "integer" in str(info.value)


def test_graph_pool_estimate() -> None:
    # 1 MiB of activations per warm-up token; 256 rows of 32 heads, 16 splits of 130 fp32.
    memory = GpuMemory(80 * GIB, 0, 0, 2048 * MIB, 2048)
    assert graph_pool_bytes(memory, 256, 32, 128) == 256 * MIB + 256 * 32 * 16 * 130 * 4


def test_graph_pool_is_in_the_budget_by_default_on_cuda(measured) -> None:
    """Graphs are on by default on CUDA with the Triton kernels and one rank, and the budget
    leaves their pool out exactly then."""
    model = fake_model(32, 8, 128, 32)
    eager = (int(80 * GIB * 0.9) - 18 * GIB) // LLAMA_8B_BLOCK
    graph_bytes = graph_pool_bytes(H100, 128, 32, 128)  # default max_num_seqs 128
    assert graph_bytes == 128 * MIB + 128 * 32 * 16 * 130 * 4
    with_graphs = (int(80 * GIB * 0.9) - 18 * GIB - graph_bytes) // LLAMA_8B_BLOCK
    args = (CUDA, torch.bfloat16, SINGLE, 32768)
    assert size_kv_pool(EngineConfig(), model, *args, True) == with_graphs
    assert size_kv_pool(EngineConfig(enforce_eager=True), model, *args, True) == eager
    assert size_kv_pool(EngineConfig(), model, *args, False) == eager  # torch attention: eager


def test_piecewise_pool_is_in_the_budget_when_asked(measured) -> None:
    """`cuda_graph_mode` piecewise also reserves the pieces' pool: 1 MiB of activations per
    warm-up token here, for the largest captured step (512 tokens, or a smaller step budget);
    none where the model's steps are not captured in pieces (an attention without the parts
    `PiecewiseGraphs` runs)."""
    model = fake_model(32, 8, 128, 32)
    args = (CUDA, torch.bfloat16, SINGLE, 32768)
    assert piecewise_pool_bytes(H100, 512) == 512 * MIB
    base = int(80 * GIB * 0.9) - 18 * GIB - graph_pool_bytes(H100, 128, 32, 128)
    piecewise = EngineConfig(cuda_graph_mode="piecewise")
    assert size_kv_pool(piecewise, model, *args, True) == (base - 512 * MIB) // LLAMA_8B_BLOCK
    small = EngineConfig(cuda_graph_mode="piecewise", max_num_batched_tokens=256)
    assert size_kv_pool(small, model, *args, True) == (base - 256 * MIB) // LLAMA_8B_BLOCK
    assert size_kv_pool(EngineConfig(), model, *args, True) == base // LLAMA_8B_BLOCK
    latent = fake_model(32, 8, 128, 32)
    latent.layers = [SimpleNamespace(self_attn=object())]
    assert size_kv_pool(piecewise, latent, *args, True) == base // LLAMA_8B_BLOCK
    eager = EngineConfig(cuda_graph_mode="piecewise", enforce_eager=True)
    assert size_kv_pool(eager, model, *args, True) == (base + graph_pool_bytes(
        H100, 128, 32, 128)) // LLAMA_8B_BLOCK  # fmt: skip


def test_a_draft_model_shares_the_budget(measured) -> None:
    """A draft model's pool holds as many blocks as the target's: each block costs both
    models' bytes; on CUDA its decode graphs' pool is reserved too (at the target's
    activations per token: an upper bound). Its weights are in the measurement (loaded
    first), so nothing else is counted for them here."""
    model = fake_model(32, 8, 128, 32)
    draft = DraftSizing(block_bytes=LLAMA_8B_BLOCK // 4, num_heads=32, head_dim=64)
    args = (CUDA, torch.bfloat16, SINGLE, 32768)
    base = int(80 * GIB * 0.9) - 18 * GIB - graph_pool_bytes(H100, 128, 32, 128)
    draft_graphs = graph_pool_bytes(H100, 128, 32, 64)
    assert size_kv_pool(EngineConfig(), model, *args, True, draft) == (base - draft_graphs) // (
        LLAMA_8B_BLOCK + LLAMA_8B_BLOCK // 4
    )
    piecewise = EngineConfig(cuda_graph_mode="piecewise")
    assert size_kv_pool(piecewise, model, *args, True, draft) == (
        base - draft_graphs - 2 * 512 * MIB  # the pieces' pools of both models
    ) // (LLAMA_8B_BLOCK + LLAMA_8B_BLOCK // 4)
    eager = EngineConfig(enforce_eager=True)
    assert size_kv_pool(eager, model, *args, True, draft) == (int(80 * GIB * 0.9) - 18 * GIB) // (
        LLAMA_8B_BLOCK + LLAMA_8B_BLOCK // 4
    )
    cpu = (torch.device("cpu"), torch.bfloat16, SINGLE, 32768, False)
    budget = EngineConfig(kv_cache_memory_bytes=10 * LLAMA_8B_BLOCK)
    assert size_kv_pool(budget, model, *cpu) == 10
    assert size_kv_pool(budget, model, *cpu, draft) == 8  # 10 / 1.25


def test_worker_pool_on_a_gpu_leaves_room_for_transfers_and_graphs(measured) -> None:
    model = fake_model(32, 8, 128, 32)
    plain = size_kv_pool(
        EngineConfig(enforce_eager=True), model, CUDA, torch.bfloat16, SINGLE, 32768, True
    )
    assert plain == (int(80 * GIB * 0.9) - 18 * GIB) // LLAMA_8B_BLOCK
    worker = PrefillWorkerConfig()
    assert not worker.decodes  # a prefill worker decodes nothing: no decode graphs
    staging_and_nccl = DEFAULT_STAGING_BYTES + 4 * NCCL_COMM_BYTES  # whatever the context
    assert size_kv_pool(worker, model, CUDA, torch.bfloat16, SINGLE, 32768, True) == (
        plain - staging_and_nccl // LLAMA_8B_BLOCK
    )
    # in piecewise mode its prompt chunks run in pieces: their pool (512 tokens at 1 MiB), and
    # still no decode graphs'
    pieces = PrefillWorkerConfig(cuda_graph_mode="piecewise")
    assert size_kv_pool(pieces, model, CUDA, torch.bfloat16, SINGLE, 32768, True) == (
        (int(80 * GIB * 0.9) - 18 * GIB - staging_and_nccl - 512 * MIB) // LLAMA_8B_BLOCK
    )
    graphs = DecodeWorkerConfig(enforce_eager=False, max_num_seqs=256)
    graph_bytes = graph_pool_bytes(H100, 256, 32, 128)
    assert (
        size_kv_pool(graphs, model, CUDA, torch.bfloat16, SINGLE, 32768, True)
        == (int(80 * GIB * 0.9) - 18 * GIB - staging_and_nccl - graph_bytes) // LLAMA_8B_BLOCK
    )


def test_tiny_model_on_a_huge_gpu_is_clamped_to_32_bit_offsets(
    measured, caplog: pytest.LogCaptureFixture
) -> None:
    measured[0] = GpuMemory(80 * GIB, 0, 1 * MIB, 1 * MIB, 2048)
    model = fake_model(2, 2, 16, 4)  # 2 layers, 2 KV heads of 16: 8 KiB a block in fp32
    limit = KVCacheSpec(2, 2, 16).max_addressable_blocks(16)
    assert limit == INT32_MAX // (2 * 16 * 2 * 16)
    with caplog.at_level(logging.WARNING, logger="duet.engine.kv_sizing"):
        num_blocks = size_kv_pool(
            EngineConfig(enforce_eager=True), model, CUDA, torch.float32, SINGLE, 2048, True
        )  # 72 GiB - 2 MiB: 9436928 blocks
    assert num_blocks == limit
    assert 2 * num_blocks * 16 * 2 * 16 <= INT32_MAX < 2 * (num_blocks + 1) * 16 * 2 * 16
    assert f"KV pool clamped from 9436928 to {limit} blocks" in caplog.text
    # An explicit count and a CPU budget are held to the same limit.
    explicit = EngineConfig(num_kv_blocks=limit + 5)
    assert size_kv_pool(explicit, model, CUDA, torch.float32, SINGLE, 2048, True) == limit
    cpu_budget = EngineConfig(kv_cache_memory_bytes=1 << 40)
    cpu = torch.device("cpu")
    assert size_kv_pool(cpu_budget, model, cpu, torch.float32, SINGLE, 2048, False) == limit
