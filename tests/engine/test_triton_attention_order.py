"""The Triton prefill and decode kernels follow one order of arithmetic per query row
(engine/kernels/triton_attention_order.py): for a 700-token context (three 256-key
partitions) at SmolLM2's attention shape, in fp32, a row's output is bitwise the same
prefilled whole, in chunks of 7, 16 or 61 tokens, after a prefix-cache hit, or as a decode
step, and matches the torch reference.

Chunks of one prompt run as separate requests of one launch (over the same cache and block
table), which is also a batch of unequal chunks. Interpreted without CUDA."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from duet.engine.attention import GatherWorkspace, paged_attention
from duet.engine.attention_metadata import AttentionMetadata
from tests.engine.triton_cases import (
    BF16_TOL,
    DEVICE,
    FP32_TOL,
    make_case,
    triton_interpreter,  # noqa: F401 (autouse fixture)
)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

# SmolLM2's attention (9 query heads over 3 KV heads, head_dim 64, 16-token blocks), one KV
# head of it: each (request, query tile, KV head) is its own program, so one KV head's three
# query heads run exactly the code and tiles of the full shape, at a third of the time.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 3, 1, 64, 16
LENGTH = 700
I32 = dict(dtype=torch.int32, device=DEVICE)


@pytest.fixture(scope="module")
def prompt():
    """A cache holding one prompt's K/V (written), its block ids, and a query per position."""
    (cache, query, _, _), block_ids = make_case(
        [LENGTH], [LENGTH], HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.float32, seed=3
    )
    return cache, query, block_ids[0]


def prefill_chunks(prompt, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """Rows [start, end) of the prompt for each (start, end) in `bounds`, each chunk its own
    request of one prefill launch that has the chunk's first `start` tokens cached."""
    from duet.engine.kernels.triton_prefill import paged_prefill_attention

    cache, query, blocks = prompt
    q = torch.cat([query[a:b] for a, b in bounds]).contiguous()
    out = torch.full_like(q, float("nan"))
    starts = [0]
    for a, b in bounds:
        starts.append(starts[-1] + b - a)
    table = torch.tensor(blocks, **I32).repeat(len(bounds), 1)
    seq_lens = torch.tensor([b for _, b in bounds], **I32)
    paged_prefill_attention(
        out, q, cache, torch.tensor(starts, **I32), seq_lens, table,
        torch.arange(len(bounds), **I32), max(b - a for a, b in bounds), q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


def chunked(prompt, size: int, first: int = 0) -> torch.Tensor:
    return prefill_chunks(prompt, [(a, min(a + size, LENGTH)) for a in range(first, LENGTH, size)])


@pytest.fixture(scope="module")
def whole(prompt):
    return prefill_chunks(prompt, [(0, LENGTH)])


def test_whole_prefill_matches_the_reference(prompt, whole):
    cache, query, blocks = prompt
    meta = AttentionMetadata.build([LENGTH], [LENGTH], [blocks], BLOCK, DEVICE)
    # the step's K/V: what the cache holds at the prompt's slots
    slots = torch.as_tensor(meta.slot_mapping, device=DEVICE)
    k, v = (cache[i].flatten(0, 1)[slots] for i in (0, 1))
    ref = paged_attention(query, k, v, cache.clone(), meta, HEAD_DIM**-0.5, GatherWorkspace())
    torch.testing.assert_close(whole, ref, **FP32_TOL)


@pytest.mark.parametrize(("size", "first"), [(7, 448), (16, 448), (61, 0)])
def test_chunked_prefill_is_bitwise_the_whole_prefill(prompt, whole, size, first):
    """Chunks of 61 over the whole prompt; of 7 and 16 over its last 252 tokens (the
    interpreter is slow), whose chunks start on both sides of the partition boundary at 512
    and end mid-partition."""
    assert torch.equal(chunked(prompt, size, first), whole[first:])


def test_prefix_hit_is_bitwise_the_cold_prefill(prompt, whole):
    """A prefix-cache hit of 20 blocks (320 tokens, into the second partition) computes the
    rest as one chunk starting there."""
    assert torch.equal(chunked(prompt, LENGTH, first=320), whole[320:])


@pytest.mark.parametrize("position", [255, 256, LENGTH - 1])
@pytest.mark.parametrize("batch", [1, 300])  # split by partition and folded; one walk
def test_decode_is_bitwise_the_prefill_row(prompt, whole, position, batch):
    """The deterministic decode launch at a partition's last key, its next partition's first,
    and the prompt's last token; launched as for one request on an H100 (a program per
    partition, then a left fold) and as for a batch of 300 (one program walks them all)."""
    from duet.engine.kernels.triton_decode import choose_splits

    splits, partition = choose_splits(batch, KV_HEADS, position + 1, 132, True)
    assert (splits, partition) == ((position + 256) // 256 if batch == 1 else 1, 256)
    assert torch.equal(decode_row(prompt, position, batch), whole[position])


def decode_row(prompt, position: int, batch: int) -> torch.Tensor:
    """The deterministic decode launch's output for the query at `position`, launched as for
    `batch` requests on a 132-SM H100 (1: a program per partition, then the fold)."""
    from duet.engine.kernels.triton_decode import choose_splits, paged_decode_attention

    cache, query, blocks = prompt
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    splits, partition = choose_splits(batch, kv_heads, position + 1, 132, True)
    q = query[position : position + 1].contiguous()
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        out, q, cache, torch.arange(2, **I32), torch.tensor([position + 1], **I32),
        torch.tensor([blocks], **I32), torch.zeros(1, **I32), head_dim**-0.5, splits, partition,
    )  # fmt: skip
    return out[0]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the compiled bf16 test below covers CUDA")
def test_bf16_emulated_chunks_prefix_hit_and_decode_are_bitwise_the_whole_prefill():
    """bf16 in the interpreter, through the kernels' emulation of a 16-bit dot (operands,
    probabilities included, rounded to bf16 and multiplied exactly in fp32;
    `triton_operands.dot_dtype`): chunks of 61, a 320-token prefix hit, and the decode at the
    last position split by partition and folded (a batch of 1) and in one walk (300) all give
    the whole prefill's rows bitwise, and the prefill stays close to the fp32 reference."""
    (cache, query, _, _), block_ids = make_case(
        [LENGTH], [LENGTH], HEADS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, seed=5
    )
    prompt = (cache, query, block_ids[0])
    whole = prefill_chunks(prompt, [(0, LENGTH)])
    assert whole.dtype == torch.bfloat16 and not whole.isnan().any()
    assert torch.equal(chunked(prompt, 61, first=448), whole[448:])
    assert torch.equal(chunked(prompt, LENGTH, first=320), whole[320:])
    for batch in (1, 300):
        assert torch.equal(decode_row(prompt, LENGTH - 1, batch), whole[-1]), batch
    meta = AttentionMetadata.build([LENGTH], [LENGTH], [block_ids[0]], BLOCK, DEVICE)
    slots = torch.as_tensor(meta.slot_mapping, device=DEVICE)
    f32 = cache.float()
    k, v = (f32[i].flatten(0, 1)[slots] for i in (0, 1))
    ref = paged_attention(query.float(), k, v, f32, meta, HEAD_DIM**-0.5, GatherWorkspace())
    torch.testing.assert_close(whole.float(), ref, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA: the interpreter's bf16 dot is wrong")
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128)])  # SmolLM2, Llama-8B
def test_bf16_on_gpu_decode_chunks_and_prefix_hits_are_bitwise_the_whole_prefill(shape):
    """Compiled in bf16 (the tiles and warps a GPU runs, `make gpu-check`)."""
    from duet.engine.kernels.triton_decode import choose_splits, paged_decode_attention

    heads, kv_heads, head_dim = shape
    (cache, query, _, _), block_ids = make_case(
        [LENGTH], [LENGTH], heads, kv_heads, head_dim, BLOCK, torch.bfloat16, seed=3
    )
    prompt = (cache, query, block_ids[0])
    whole = chunked(prompt, LENGTH)
    for size in (7, 16, 61):
        assert torch.equal(chunked(prompt, size), whole), size
    assert torch.equal(chunked(prompt, LENGTH, first=320), whole[320:])
    q = query[LENGTH - 1 :].contiguous()
    out = torch.empty_like(q)
    splits, partition = choose_splits(1, kv_heads, LENGTH, 132, True)
    paged_decode_attention(
        out, q, cache, torch.arange(2, **I32), torch.tensor([LENGTH], **I32),
        torch.tensor(block_ids, **I32), torch.zeros(1, **I32), head_dim**-0.5, splits, partition,
    )  # fmt: skip
    assert torch.equal(out[0], whole[-1])
