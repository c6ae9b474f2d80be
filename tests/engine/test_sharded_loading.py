"""Each tensor-parallel rank reads only the slices it holds: from safetensors (byte ranges of
its rows or columns), from GGUF (whole quantization blocks), and `--load-format dummy` makes
only its slice, with the values the full tensor has there. The bytes each rank reads are
counted: N ranks read the checkpoint once between them, plus the tensors every rank holds
(norms) and KV heads replicated where TP exceeds them."""

from __future__ import annotations

import pytest
import torch

from duet.engine.dummy_weights import dummy_weights
from duet.engine.loader import load_model, open_model
from duet.engine.model import LlamaForCausalLM, ModelArchConfig
from duet.engine.parallel import TensorParallel
from duet.engine.weight_files import ReadStats
from tests.conftest import SMOLLM2_SHAPES

CPU = torch.device("cpu")


def _rank_model(arch: ModelArchConfig, rank: int, world: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(arch, None, TensorParallel(rank, world))


def _check_ranks(source, world: int, full: dict[str, torch.Tensor]) -> list[int]:
    """Every rank's tensors equal its slice of the full ones; returns the bytes each read."""
    reads = []
    for rank in range(world):
        net = _rank_model(source.arch, rank, world)
        stats = ReadStats()
        names = set()
        for name, tensor in source.weights(net.weight_slice, stats):
            part = net.weight_slice(name, tuple(full[name].shape))
            whole = full[name]
            if part is not None and tensor.shape[part.dim] != whole.shape[part.dim]:
                whole = whole.narrow(part.dim, part.start, part.end - part.start)
            assert torch.equal(tensor, whole), name
            names.add(name)
        assert names == set(full)
        reads.append(stats.num_bytes)
    return reads


def _norm_bytes(full: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for n, t in full.items() if n.endswith("norm.weight"))


def _kv_bytes(full: dict[str, torch.Tensor], arch: ModelArchConfig) -> int:
    """One KV head's k and v rows over every layer."""
    rows = arch.head_dim * arch.hidden_size * 4  # fp32
    return 2 * rows * arch.num_hidden_layers


@pytest.mark.parametrize("world", [2, 3, 4])
def test_safetensors_ranks_read_the_checkpoint_once_between_them(
    smollm2_shaped: str, world: int
) -> None:
    source = open_model(smollm2_shaped)
    stats = ReadStats()
    full = dict(source.weights(None, stats))
    total = stats.num_bytes
    assert total == sum(t.nbytes for t in full.values())
    reads = _check_ranks(source, world, full)
    norms = _norm_bytes(full)
    # SmolLM2's shapes (conftest), untied: only the norms are whole on every rank; at TP 4
    # > 3 KV heads, KV head 0 is on two.
    replicated_kv = _kv_bytes(full, source.arch) if world == 4 else 0
    assert sum(reads) == total + (world - 1) * norms + replicated_kv
    if world == 3:  # 3 KV groups over 3 ranks: 1/N each, but for 512 / 3 embedding rows
        row = source.arch.hidden_size * 4
        assert max(reads) <= (total - norms) / 3 + norms + row


def test_even_split_reads_at_most_one_nth_plus_replicated(tiny_llama: str) -> None:
    source = open_model(tiny_llama)
    full = dict(source.weights(None, None))
    total = sum(t.nbytes for t in full.values())
    norms = _norm_bytes(full)
    reads = _check_ranks(source, 2, full)
    assert reads == [(total - norms) // 2 + norms] * 2


def test_gguf_ranks_read_their_rows_and_blocks() -> None:
    """The embedded SmolLM2 GGUF (Q4_1 projections, a Q8_0 embedding): rows are read alone;
    columns too where a rank's share starts and ends on 32-element blocks (o_proj's 192 and
    384, down_proj's 768 or 512), so no rank reads another's blocks."""
    source = open_model(None)
    stats = ReadStats()
    full = dict(source.weights(None, stats))
    reads = _check_ranks(source, 3, full)
    norms = sum(t.numel() * 4 for n, t in full.items() if n.endswith("norm.weight"))
    assert sum(reads) == stats.num_bytes + 2 * norms
    assert max(reads) <= (stats.num_bytes - norms) / 3 + norms


@pytest.mark.parametrize("world", [2, 4])
def test_dummy_ranks_make_their_slice_of_the_same_tensor(world: int) -> None:
    arch = ModelArchConfig.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "num_hidden_layers": 1,
         "tie_word_embeddings": True, **SMOLLM2_SHAPES}
    )  # fmt: skip
    full = dict(dummy_weights(arch, torch.bfloat16, CPU))
    for rank in range(world):
        net = _rank_model(arch, rank, world)
        for name, tensor in dummy_weights(arch, torch.bfloat16, CPU, net.weight_slice):
            part = net.weight_slice(name, tuple(full[name].shape))
            whole = full[name]
            if part is not None:
                whole = whole.narrow(part.dim, part.start, part.end - part.start)
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, whole), name


def test_rank_loads_what_it_reads(tiny_llama: str) -> None:
    """`load_model` at rank 1 of 2 reports the bytes it read (half the projections)."""
    loaded = load_model(
        tiny_llama, torch.float32, CPU, progress=False, tp=TensorParallel(1, 2),
        deterministic=False,
    )  # fmt: skip
    full = dict(open_model(tiny_llama).weights(None, None))
    total, norms = sum(t.nbytes for t in full.values()), _norm_bytes(full)
    assert loaded.checkpoint_bytes_read == (total - norms) // 2 + norms
    assert loaded.model.num_kv_heads == 1
