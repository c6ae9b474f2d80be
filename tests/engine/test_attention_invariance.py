"""The CPU attention kernels follow one order of arithmetic per query row
(engine/kernels/attention_order.h; for bf16 on CPUs with AMX tiles, attention_amx.h): a token's
output has the same bits from the decode and the prefill kernel, alone or in a batch, at any
thread count, in a chunk starting anywhere. Each test runs in both orders where the CPU has
both."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_cpu_kernels import random_decode_batch

# (heads, KV heads, head_dim, block size): SmolLM2, Llama-8B, a block size off the vector
# width (runs of one key), a block wider than the vector (two runs per block), 20 query heads
# per KV head (the AMX order's rows in two tiles of 16 and 4), and 16 heads over DeepSeek's
# latent entry (multi-head latent attention: one KV head of 576).
SHAPES = [
    (9, 3, 64, 16),
    (32, 8, 128, 16),
    (4, 2, 16, 7),
    (6, 2, 32, 32),
    (40, 2, 64, 16),
    (16, 1, 576, 16),
]
LENGTHS = [700, 37, 300, 1200, 5, 257, 256, 513, 129]  # one and several partitions
DTYPES = [torch.float32, torch.bfloat16]


def _decode(module, batch, which, scale):
    query, key_cache, value_cache, tables, lens, rows = batch
    out = torch.zeros_like(query)
    module.paged_decode_attention(
        out, query, key_cache, value_cache, tables[which], lens[which], rows[which], scale
    )
    return out[rows[which]]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-BS{}".format(*s))
def test_decode_is_the_same_alone_in_a_batch_and_at_any_thread_count(
    kernels, attention_order, shape, dtype
):
    batch = random_decode_batch(shape, dtype, LENGTHS)
    scale = shape[2] ** -0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = _decode(kernels, batch, slice(None), scale)
        # alone, a sequence is one item (or a few partitions) for more threads: its query heads
        # are then split over the threads (in 2, 3 or 5 ranges, across KV-head boundaries, with
        # a slot of a partitioned sequence shared by the ranges), and must change no bit
        alone = {}
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            alone[threads] = [
                _decode(kernels, batch, slice(i, i + 1), scale) for i in range(len(LENGTHS))
            ]
    finally:
        torch.set_num_threads(before)
    for threads, outs in alone.items():
        for i, out in enumerate(outs):
            assert torch.equal(out[0], together[i]), (threads, LENGTHS[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-BS{}".format(*s))
def test_prefill_rows_equal_decode_at_their_position_whatever_the_chunk(
    kernels, attention_order, shape, dtype
):
    """Each of a sequence's last tokens, computed as a decode step (one row, its position's
    length) and as a row of prefill chunks that start at different positions: one result."""
    if not kernels.prefill_head_dim_supported(shape[2]):
        pytest.skip("head_dim off the vector width: the prefill kernel refuses it (SDPA path)")
    length = 300
    _, key_cache, value_cache, tables, _, _ = random_decode_batch(shape, dtype, [length])
    scale = shape[2] ** -0.5
    g = torch.Generator().manual_seed(5)
    q = torch.randn(length, shape[0], shape[2], generator=g).to(dtype)
    table = tables[:1]
    # A chunk of the last tokens, from chunk_start; the last one token alone (G rows: the AMX
    # order's softmax a row at a time, as in decode, where 16-row tiles take it a key at a time).
    for chunk_start in (0, 100, 257, 290, 299):
        n = length - chunk_start
        out = torch.zeros_like(q)
        kernels.paged_prefill_attention(
            out, q, key_cache, value_cache, table, torch.tensor([length]),
            torch.tensor([chunk_start]), torch.tensor([n]), scale,
        )  # fmt: skip
        for pos in (chunk_start, (chunk_start + length) // 2, length - 1):
            dec = torch.zeros_like(q)
            kernels.paged_decode_attention(
                dec, q, key_cache, value_cache, table, torch.tensor([pos + 1]),
                torch.tensor([pos]), scale,
            )  # fmt: skip
            assert torch.equal(out[pos], dec[pos]), (chunk_start, pos)


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)


def test_bf16_attention_takes_the_amx_order_exactly_where_the_cpu_and_shape_allow(kernels):
    has_amx = _cpu_has_amx() and kernels.simd_lanes() == 16
    assert kernels.attention_amx_used(64, 16) is has_amx  # SmolLM2
    assert kernels.attention_amx_used(128, 32) is has_amx  # Llama-8B, 32-token blocks
    assert kernels.attention_amx_used(48, 16) is False  # head_dim not a multiple of 32
    assert kernels.attention_amx_used(96, 16) is False  # nor 32, 64, 128 or 256
    assert kernels.attention_amx_used(64, 7) is False  # blocks not a multiple of 16 keys
    assert kernels.attention_amx_used(512, 16) is False  # over 256 dims
    try:
        assert kernels.attention_amx(False) is False
        assert kernels.attention_amx_used(64, 16) is False
    finally:
        kernels.attention_amx(True)
