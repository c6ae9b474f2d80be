"""Deterministic inference on the Triton path (issue #19, GPU half): a query row's attention
follows one order of arithmetic (engine/kernels/triton_attention_order.py) whatever the batch,
the chunk it is prefilled in, where that chunk starts, or whether the decode or the prefill
kernel runs it; bitwise.

The launch's split count is chosen as an H100 (132 SMs) would choose it; the kernels run in
Triton's interpreter without CUDA (fp32: the interpreter's bf16 `tl.dot` is wrong)."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from duet.engine.attention import GatherWorkspace, paged_attention
from duet.engine.attention_metadata import AttentionMetadata
from tests.engine.triton_cases import (
    DEVICE,
    FP32_TOL,
    make_case,
    triton_interpreter,  # noqa: F401 (autouse fixture)
)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

H100_SMS = 132
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2's attention
I32 = dict(dtype=torch.int32, device=DEVICE)


def decode_rows(cache, query, block_ids, seq_lens, rows, deterministic):
    """The decode kernel over the requests `rows` of one cache, launched as on an H100."""
    from duet.engine.kernels.triton_decode import choose_splits, paged_decode_attention

    lens = [seq_lens[i] for i in rows]
    width = max(len(block_ids[i]) for i in rows)
    table = torch.zeros(len(rows), width, **I32)
    for r, i in enumerate(rows):
        table[r, : len(block_ids[i])] = torch.tensor(block_ids[i], **I32)
    splits, partition = choose_splits(len(rows), KV_HEADS, max(lens), H100_SMS, deterministic)
    q = query[rows].contiguous()
    out = torch.zeros_like(q)
    starts = torch.arange(len(rows) + 1, **I32)
    decode = torch.arange(len(rows), **I32)
    paged_decode_attention(
        out, q, cache, starts, torch.tensor(lens, **I32), table, decode, HEAD_DIM**-0.5,
        splits, partition,
    )  # fmt: skip
    return out, splits


@pytest.fixture(scope="module")
def case():
    # request 0 alone, then beside long requests that change the adaptive launch's split count
    seq_lens = [700, 2000, 41, 1500]
    (cache, query, _, _), block_ids = make_case(
        [1] * 4, seq_lens, HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32
    )
    return cache, query, block_ids, seq_lens


def test_deterministic_decode_is_bitwise_the_same_in_any_batch(case):
    cache, query, block_ids, seq_lens = case
    alone, splits_alone = decode_rows(cache, query, block_ids, seq_lens, [0], True)
    batched, splits_batched = decode_rows(cache, query, block_ids, seq_lens, [1, 0, 2, 3], True)
    assert (splits_alone, splits_batched) == (3, 8)  # partitions of the longest request
    assert torch.equal(batched[1], alone[0])


def test_adaptive_splits_change_the_bits_with_the_batch(case):
    """What deterministic inference mends: the default launch cuts request 0 into splits
    sized from the whole batch, so its output depends on its neighbours (alone: 11 splits of
    64 tokens; among 9 requests, 27 programs: 10 splits, so 96 tokens each)."""
    cache, query, block_ids, seq_lens = case
    alone, splits_alone = decode_rows(cache, query, block_ids, seq_lens, [0], False)
    rows = [1, 0, 2, 3, 1, 2, 3, 1, 2]
    batched, splits_batched = decode_rows(cache, query, block_ids, seq_lens, rows, False)
    assert (splits_alone, splits_batched) == (11, 10)
    assert not torch.equal(batched[1], alone[0])
    torch.testing.assert_close(batched[1], alone[0], **FP32_TOL)


def test_deterministic_decode_matches_the_reference(case):
    cache, query, block_ids, seq_lens = case
    out, _ = decode_rows(cache, query, block_ids, seq_lens, [0, 1, 2, 3], True)
    meta = AttentionMetadata.build([1] * 4, seq_lens, block_ids, BLOCK, DEVICE)
    unused = query[:, :KV_HEADS]  # decodes read all their K/V from the cache
    ref = paged_attention(query, unused, unused, cache, meta, HEAD_DIM**-0.5, GatherWorkspace())
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_the_engine_passes_deterministic_to_the_triton_metadata(case):
    _, _, block_ids, seq_lens = case
    for deterministic, partition in ((True, 256), (False, 0)):
        meta = AttentionMetadata.build(
            [1] * 4, seq_lens, block_ids, BLOCK, DEVICE, triton_num_kv_heads=KV_HEADS,
            deterministic=deterministic,
        )  # fmt: skip
        assert meta.kernel_batch is not None
        assert meta.kernel_batch.split_partition == partition


def test_deterministic_decode_splits_by_partition_only_where_the_gpu_would_idle():
    from duet.engine.kernels.triton_decode import MAX_PARTITION_SPLITS, choose_splits

    assert choose_splits(1, 8, 700, H100_SMS, True) == (3, 256)  # 8 programs: by partition
    assert choose_splits(33, 8, 700, H100_SMS, True) == (1, 256)  # 264: one walk each
    longest = MAX_PARTITION_SPLITS * 256
    assert choose_splits(1, 8, longest, H100_SMS, True) == (MAX_PARTITION_SPLITS, 256)
    assert choose_splits(1, 8, longest + 1, H100_SMS, True) == (1, 256)
