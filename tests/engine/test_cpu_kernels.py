"""The C++ CPU kernels (engine/kernels/*.cpp) against torch references: paged decode attention
at block boundaries, paged prefill attention (whole prompts, chunks after cached context, tile
and vector-width boundaries), GQA group sizes, head sizes that take each code path, fp32 and
bf16, one and two threads (two split long sequences and merge the parts); bad inputs rejected
(the elementwise ops: test_cpu_elementwise.py). The native SIMD width runs everywhere; the other widths'
code (16, 8, 4 lanes) also runs through separate builds with DUET_SIMD_LANES."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from duet.engine.kernels.cpu import build_cpu_kernels
from tests.engine.test_cpu_elementwise import close, hf_rms_norm

# Lengths around block boundaries (block sizes below are 1, 3, 4, 5, 7 and 16), plus long
# ones that two threads split into token ranges.
LENGTHS = [1, 2, 3, 4, 5, 15, 16, 17, 33, 64, 127, 300, 1000, 2500]
# (query heads, kv heads, head_dim, block_size): SmolLM2; Llama-3-8B; multi-head (G = 1);
# Qwen2-7B's G = 7; head sizes that are not a multiple of the vector width (run-time or scalar
# lanes); one-token blocks.
SHAPES = [
    (9, 3, 64, 16),
    (32, 8, 128, 16),
    (8, 8, 16, 4),
    (14, 2, 128, 16),
    (6, 2, 24, 3),
    (4, 1, 20, 5),
    (4, 2, 256, 1),
    (6, 3, 48, 7),
    (14, 2, 64, 16),  # G = 7: value rows shared by chunks of heads, plus a remainder chunk
    (6, 2, 8, 4),  # one-vector rows at 8 lanes: keys shared by all heads there too
]


def reference_decode(query, key_cache, value_cache, tables, lens, scale):
    """Per sequence: gather its KV in order, softmax attention in fp32."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape[0], num_heads, head_dim)
    for i, length in enumerate(lens.tolist()):
        blocks = tables[i, : -(-length // block_size)]
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out


def random_decode_batch(shape, dtype, lens, seed=0):
    """Caches with scattered block tables, and query rows at scattered positions of a flat
    batch that has other rows too."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    g = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in lens]
    total = sum(num_blocks) + 3
    key_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lens), max(num_blocks) + 2, dtype=torch.long)  # padded rows
    used = 0
    for row, n in enumerate(num_blocks):
        tables[row, :n] = perm[used : used + n]
        used += n
    num_tokens = len(lens) + 3
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    rows = torch.randperm(num_tokens, generator=g)[: len(lens)]
    return query, key_cache, value_cache, tables, torch.tensor(lens), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-BS{}".format(*s))
def test_decode_matches_reference(kernels, attention_order, threads, shape, dtype):
    query, key_cache, value_cache, tables, lens, rows = random_decode_batch(shape, dtype, LENGTHS)
    scale = shape[2] ** -0.5
    out = torch.full_like(query, 7.0)
    kernels.paged_decode_attention(out, query, key_cache, value_cache, tables, lens, rows, scale)
    ref = reference_decode(query[rows], key_cache, value_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out[rows].float(), ref, atol=tol, rtol=tol)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert bool((out[others] == 7.0).all())  # rows that are not decodes stay untouched


def test_long_sequence_split_across_threads_matches_one_thread(kernels):
    """One 3000-token sequence: two threads split it into token ranges and merge the parts."""
    query, key_cache, value_cache, tables, lens, rows = random_decode_batch(
        (9, 3, 64, 16), torch.float32, [3000], seed=1
    )
    outs = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.zeros_like(query)
            kernels.paged_decode_attention(
                out, query, key_cache, value_cache, tables, lens, rows, 0.125
            )
            outs.append(out[rows])
    finally:
        torch.set_num_threads(before)
    ref = reference_decode(query[rows], key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(outs[1], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, lens, r: t.__setitem__((0, 0), 10_000), "block_tables[0, 0] = 10000"),
        (lambda t, lens, r: t.__setitem__((1, 0), -1), "block_tables[1, 0] = -1"),
        (lambda t, lens, r: lens.__setitem__(0, 0), "seq_lens[0] = 0"),
        (lambda t, lens, r: lens.__setitem__(1, 10_000), "seq_lens[1] = 10000"),
        (lambda t, lens, r: r.__setitem__(0, 99), "token_indices[0] out of range"),
    ],
    ids=["block-past-cache", "negative-block", "empty-sequence", "past-table", "bad-row"],
)
def test_decode_rejects_bad_indices(kernels, change, message):
    query, key_cache, value_cache, tables, lens, rows = random_decode_batch(
        (4, 2, 16, 4), torch.float32, [5, 9]
    )
    change(tables, lens, rows)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.paged_decode_attention(
            torch.empty_like(query), query, key_cache, value_cache, tables, lens, rows, 0.25
        )


def test_decode_rejects_mixed_dtypes(kernels):
    query, key_cache, value_cache, tables, lens, rows = random_decode_batch(
        (4, 2, 16, 4), torch.float32, [5]
    )
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.paged_decode_attention(
            torch.empty_like(query),
            query,
            key_cache,
            value_cache.bfloat16(),
            tables,
            lens,
            rows,
            0.25,
        )


# (seq_len, query_len): whole prompts, chunks after earlier chunks or a prefix hit, single
# tokens, lengths around the vector width and the kernel's 32-token tiles, and a long prompt.
PREFILL_REQUESTS = [(5, 5), (1, 1), (40, 40), (100, 33), (33, 17), (31, 31), (32, 32), (65, 64)]
PREFILL_REQUESTS += [(300, 1), (700, 700), (2, 2)]


def reference_prefill(query, key_cache, value_cache, tables, lens, starts, query_lens, scale):
    """Per request: gather its KV in order, causal softmax attention in fp32 of its query rows
    (the last query_lens of its tokens)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape[0], num_heads, head_dim)
    for i, (length, start, n) in enumerate(
        zip(lens.tolist(), starts.tolist(), query_lens.tolist(), strict=True)
    ):
        blocks = tables[i, : -(-length // block_size)]
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", query[start : start + n].float(), k) * scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = torch.einsum("htk,khd->thd", scores.softmax(-1), v)
    return out


def random_prefill_batch(shape, dtype, requests, seed=0):
    """Caches with scattered block tables; each request's query rows sit in a flat batch after
    a gap row that belongs to no request."""
    lens = [length for length, _ in requests]
    _, key_cache, value_cache, tables, _, _ = random_decode_batch(shape, dtype, lens, seed)
    query_lens = torch.tensor([n for _, n in requests])
    starts = torch.cumsum(query_lens + 1, 0) - query_lens  # row 0 and one row between requests
    num_tokens = int(starts[-1] + query_lens[-1]) + 1
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(num_tokens, shape[0], shape[2], generator=g).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens), starts, query_lens


def run_prefill(module, batch, scale=0.25):
    """The kernel over a `random_prefill_batch`; returns its output (a new tensor)."""
    query = batch[0]
    out = torch.empty_like(query)
    module.paged_prefill_attention(out, *batch, scale)
    return out


def prefill_rows(starts, query_lens):
    return torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts.tolist(), query_lens.tolist(), strict=True)]
    )


PREFILL_SHAPES = [s for s in SHAPES if s[2] in (16, 64, 128, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-BS{}".format(*s))
def test_prefill_matches_reference(kernels, attention_order, threads, shape, dtype):
    batch = random_prefill_batch(shape, dtype, PREFILL_REQUESTS)
    query, key_cache, value_cache, tables, lens, starts, query_lens = batch
    assert kernels.prefill_head_dim_supported(shape[2])
    scale = shape[2] ** -0.5
    out = torch.full_like(query, 7.0)
    kernels.paged_prefill_attention(
        out, query, key_cache, value_cache, tables, lens, starts, query_lens, scale
    )
    ref = reference_prefill(query, key_cache, value_cache, tables, lens, starts, query_lens, scale)
    rows = prefill_rows(starts, query_lens)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out[rows].float(), ref[rows], atol=tol, rtol=tol)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert int(others.sum()) == len(PREFILL_REQUESTS) + 1
    assert bool((out[others] == 7.0).all())  # rows of no request stay untouched


def test_prefill_head_sizes_off_the_vector_width_are_refused(kernels):
    lanes = kernels.simd_lanes()
    assert kernels.prefill_head_dim_supported(4 * lanes)
    assert not kernels.prefill_head_dim_supported(4 * lanes + 1)
    assert not kernels.prefill_head_dim_supported(3 * lanes)
    batch = random_prefill_batch((4, 2, 3 * lanes, 4), torch.float32, [(5, 5)])
    with pytest.raises(RuntimeError, match=f"head_dim {3 * lanes} unsupported"):
        run_prefill(kernels, batch)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, lens, s, n: t.__setitem__((0, 0), 10_000), "block_tables[0, 0] = 10000"),
        (lambda t, lens, s, n: lens.__setitem__(0, 0), "seq_lens[0] = 0"),
        (lambda t, lens, s, n: n.__setitem__(1, 10), "query_lens[1] = 10 outside [1, 9]"),
        (lambda t, lens, s, n: n.__setitem__(0, 0), "query_lens[0] = 0"),
        (lambda t, lens, s, n: s.__setitem__(1, 1000), "query rows of request 1"),
    ],
    ids=["block-past-cache", "empty-sequence", "query-past-sequence", "no-query", "bad-rows"],
)
def test_prefill_rejects_bad_indices(kernels, change, message):
    lanes = kernels.simd_lanes()
    batch = random_prefill_batch((4, 2, lanes, 4), torch.float32, [(5, 5), (9, 4)])
    _, _, _, tables, lens, starts, query_lens = batch
    change(tables, lens, starts, query_lens)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run_prefill(kernels, batch)


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_other_simd_widths_match_reference(kernels, lanes):
    """Builds of the other vector widths (16: AVX-512, 8: AVX2, 4: SSE/NEON) on any CPU (GCC
    splits or pads the vectors): decode and elementwise ops, so every width's code paths run
    in CI whatever CPU it has."""
    if kernels.simd_lanes() == lanes:
        pytest.skip(f"the native build has {lanes} lanes: the other tests run it")
    wide = build_cpu_kernels((f"DUET_SIMD_LANES={lanes}",))
    assert wide.simd_lanes() == lanes
    shapes = [(9, 3, 64, 16), (14, 2, 128, 16), (14, 2, 64, 16), (6, 2, 24, 3), (4, 1, 32, 5)]
    shapes += [(6, 2, 8, 4), (6, 3, 4, 2)]  # rows of one vector at 8 and at 4 lanes
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            query, kc, vc, tables, lens, rows = random_decode_batch(shape, dtype, LENGTHS)
            out = torch.zeros_like(query)
            wide.paged_decode_attention(out, query, kc, vc, tables, lens, rows, 0.1)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            ref = reference_decode(query[rows], kc, vc, tables, lens, 0.1)
            torch.testing.assert_close(out[rows].float(), ref, atol=tol, rtol=tol)
            if not wide.prefill_head_dim_supported(shape[2]):
                continue
            query, kc, vc, tables, lens, starts, n = random_prefill_batch(
                shape, dtype, PREFILL_REQUESTS
            )
            out = torch.zeros_like(query)
            wide.paged_prefill_attention(out, query, kc, vc, tables, lens, starts, n, 0.1)
            ref = reference_prefill(query, kc, vc, tables, lens, starts, n, 0.1)
            rows = prefill_rows(starts, n)
            torch.testing.assert_close(out[rows].float(), ref[rows], atol=tol, rtol=tol)
        x = torch.randn(9, 576).to(dtype)
        weight = torch.rand(576).to(dtype) + 0.5
        torch.testing.assert_close(
            wide.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **close(dtype)
        )
        gate_up = torch.randn(5, 3072).to(dtype)
        gate, up = gate_up.split(1536, dim=-1)
        want = F.silu(gate) * up
        torch.testing.assert_close(wide.silu_and_mul(gate_up), want, **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_read_a_strided_query_in_place(kernels, attention_order, dtype):
    """The model hands the kernels q as a view of the q|k|v projection (each token's heads
    contiguous, tokens at the projection's stride): the same bits as the packed query, and a
    query in another layout (heads strided) is packed by the kernel."""
    shape = (9, 3, 64, 16)
    h, hkv, d, _ = shape
    query, kc, vc, tables, lens, rows = random_decode_batch(shape, dtype, LENGTHS[:8])
    fused = torch.randn(query.shape[0], (h + 2 * hkv) * d).to(dtype)
    fused[:, : h * d] = query.reshape(query.shape[0], -1)
    view = fused[:, : h * d].view(query.shape[0], h, d)
    assert not view.is_contiguous()
    swapped = query.transpose(0, 1).contiguous().transpose(0, 1)  # heads outermost
    outs = []
    for q in (query, view, swapped):
        out = torch.zeros_like(query)
        kernels.paged_decode_attention(out, q, kc, vc, tables, lens, rows, 0.125)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    batch = random_prefill_batch(shape, dtype, PREFILL_REQUESTS[:6])
    query = batch[0]
    fused = torch.randn(query.shape[0], (h + 2 * hkv) * d).to(dtype)
    fused[:, : h * d] = query.reshape(query.shape[0], -1)
    view = fused[:, : h * d].view(query.shape[0], h, d)
    want, got = torch.zeros_like(query), torch.zeros_like(query)
    kernels.paged_prefill_attention(want, query, *batch[1:], 0.25)
    kernels.paged_prefill_attention(got, view, *batch[1:], 0.25)
    assert torch.equal(got, want)
