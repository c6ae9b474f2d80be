"""duet's int8 CPU kernel (engine/kernels/quant_linear_cpu.cpp via engine/quant/cpu_linear.py):
the dequantized reference within dtype tolerance, and a row's bits independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.engine.quant.cpu_linear import (
    PANEL,
    build_quant_kernels,
    int4_linear,
    int8_linear,
    load_quant_kernels,
    pack_int4,
    pack_int8,
    unpack_int4,
    unpack_int8,
)
from duet.engine.quant.formats import quantize_int4

K = 576
NO_AMX = 1 << 62  # amx_min_rows that keeps every call off the AMX tiles
CASES = [(192, 1), (100, K // 32), (77, K // 16)]  # groups: per channel, Q8_0, Q6_K
CASE_IDS = ["per-channel", "groups-of-32", "groups-of-16-padded"]
# (activations, weights in column pairs: the AVX512-BF16 dot, or AMX tiles from 1 row)
VARIANTS = [
    (torch.float32, False, NO_AMX),
    (torch.bfloat16, False, NO_AMX),
    (torch.bfloat16, True, NO_AMX),
    (torch.bfloat16, True, 1),
]
VARIANT_IDS = ["fp32", "bf16-fma", "bf16-dot", "bf16-amx"]


def skip_unbuilt(kernels, pairs: bool, amx_min_rows: int) -> None:
    if pairs and not kernels.bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 dot is not built")
    if amx_min_rows != NO_AMX and not kernels.amx():
        pytest.skip("this CPU has no AMX: the tile path is not built")


@pytest.fixture(scope="module")
def kernels():
    module = load_quant_kernels()
    assert module is not None, "the int8 kernel must build here (g++ and ninja are dependencies)"
    return module


def weights(n: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, K), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 1e-3 + 1e-4
    return q, scale


def reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, groups = scale.shape
    return (q.float().view(n, groups, -1) * scale[..., None]).view(n, K)


@pytest.mark.parametrize(("n", "groups"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("dtype", "pairs", "amx"), VARIANTS, ids=VARIANT_IDS)
def test_equals_dequantized_reference(kernels, n: int, groups: int, dtype, pairs, amx) -> None:
    skip_unbuilt(kernels, pairs, amx)
    q, scale = weights(n, groups)
    packed, scales = pack_int8(q, scale, pairs)
    blocks = -(-n // 16)
    assert packed.shape == ((blocks, K // 2, 16, 2) if pairs else (blocks, K, 16))
    assert scales.shape == (blocks, groups, 16)
    unpacked_q, unpacked_scale = unpack_int8(packed, scales, n)
    assert torch.equal(unpacked_q, q) and torch.equal(unpacked_scale, scale)
    w = reference(q, scale)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 40, 64, 2048):  # 40: a padded row tile after two full ones
        x = torch.randn(rows, K, generator=gen).to(dtype)
        out = int8_linear(kernels, x, packed, scales, n, amx)
        assert out.shape == (rows, n) and out.dtype == dtype
        expected = F.linear(x.float(), w)
        if dtype == torch.float32:  # fp32 sums in another order
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        else:  # one bf16 rounding of the fp32 result
            torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize(("n", "groups"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("dtype", "pairs", "amx"), VARIANTS, ids=VARIANT_IDS)
def test_rows_do_not_depend_on_the_batch(kernels, n: int, groups: int, dtype, pairs, amx) -> None:
    """Bit for bit: each of 64 rows alone, the first 7 together, all 64 (row tiles of 6, or
    of 16 zero-padded for AMX, and their tails, every channel-block grouping), and 2 threads
    against 1."""
    skip_unbuilt(kernels, pairs, amx)
    q, scale = weights(n, groups)
    packed, scales = pack_int8(q, scale, pairs)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(2)).to(dtype)
    batch = int8_linear(kernels, x, packed, scales, n, amx)
    alone = torch.cat(
        [int8_linear(kernels, x[i : i + 1], packed, scales, n, amx) for i in range(64)]
    )
    assert torch.equal(batch, alone)
    assert torch.equal(int8_linear(kernels, x[:7], packed, scales, n, amx), alone[:7])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(int8_linear(kernels, x, packed, scales, n, amx), batch)
    finally:
        torch.set_num_threads(threads)


def test_amx_is_built_where_the_cpu_has_it(kernels) -> None:
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    has_amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
    assert bool(kernels.amx()) is has_amx
    # groups of 16 (Q6_K) are not a tile's depth: they keep the bf16 dot, which gives the same
    # bits for any amx_min_rows
    q, scale = weights(48, K // 16)
    if kernels.bf16_dot():
        packed, scales = pack_int8(q, scale, pairs=True)
        x = torch.randn(5, K).to(torch.bfloat16)
        assert torch.equal(int8_linear(kernels, x, packed, scales, 48, 1),
                           int8_linear(kernels, x, packed, scales, 48, NO_AMX))  # fmt: skip


def test_strided_rows_and_zero_rows(kernels) -> None:
    q, scale = weights(48, 1)
    packed, scales = pack_int8(q, scale)
    wide = torch.randn(5, 2 * K)
    x = wide[:, :K]  # rows with a stride of 2K
    assert torch.equal(int8_linear(kernels, x, packed, scales, 48),
                       int8_linear(kernels, x.contiguous(), packed, scales, 48))  # fmt: skip
    assert int8_linear(kernels, torch.empty(0, K), packed, scales, 48).shape == (0, 48)


def test_bad_operands_are_refused_with_the_operand_named(kernels) -> None:
    q, scale = weights(32, 1)
    packed, scales = pack_int8(q, scale)
    x = torch.randn(2, K)
    with pytest.raises(RuntimeError, match="q must be contiguous int8"):
        int8_linear(kernels, torch.randn(2, K + 1), packed, scales, 32)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        int8_linear(kernels, x, packed, scales.to(torch.bfloat16), 32)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        int8_linear(kernels, x.half(), packed, scales, 32)
    with pytest.raises(RuntimeError, match="n must lie in the last block"):
        int8_linear(kernels, x, packed, scales, 33)
    pairs, _ = pack_int8(q, scale, pairs=True)
    if kernels.bf16_dot():  # column pairs take bf16 activations only
        with pytest.raises(RuntimeError, match="needs bfloat16 x"):
            int8_linear(kernels, x, pairs, scales, 32)


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [4, 8])
def test_other_simd_widths_give_the_same_bits(kernels, lanes: int) -> None:
    """The AVX2 (8 lanes) and SSE/scalar (4) builds: the same reduction order, so the same bits
    as the native build (other tiles; FMA in every build here)."""
    if kernels.simd_lanes() == lanes:
        pytest.skip(f"the native build has {lanes} lanes: the other tests run it")
    other = build_quant_kernels((f"DUET_SIMD_LANES={lanes}",))
    assert other.simd_lanes() == lanes
    for n, groups in CASES:
        q, scale = weights(n, groups)
        packed, scales = pack_int8(q, scale)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(9, K).to(dtype)
            assert torch.equal(int8_linear(other, x, packed, scales, n),
                               int8_linear(kernels, x, packed, scales, n))  # fmt: skip
    q4 = quantize_int4(torch.randn(88, K) * 0.05, 32, False)
    nibbles, sz = pack_int4(q4.q, q4.scale, q4.offset, pairs=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, K).to(dtype)
        assert torch.equal(int4_linear(other, x, nibbles, sz, 88, False),
                           int4_linear(kernels, x, nibbles, sz, 88, False))  # fmt: skip


@pytest.mark.parametrize(("n", "group_size", "symmetric"), [(88, 32, False), (64, 64, True)])
@pytest.mark.parametrize(("dtype", "pairs", "amx"), VARIANTS, ids=VARIANT_IDS)
def test_int4_equals_dequantized_reference_and_rows_do_not_depend_on_the_batch(
    kernels, n: int, group_size: int, symmetric: bool, dtype: torch.dtype, pairs: bool, amx: int
) -> None:
    skip_unbuilt(kernels, pairs, amx)
    gen = torch.Generator().manual_seed(4)
    q4 = quantize_int4(torch.randn(n, K, generator=gen) * 0.05, group_size, symmetric)
    nibbles, sz = pack_int4(q4.q, q4.scale, q4.offset, pairs)
    assert nibbles.shape == (-(-n // 16), K // 2, 16) and sz.dtype == torch.bfloat16
    q, scale, offset = unpack_int4(nibbles, sz, n, pairs)
    assert torch.equal(q, q4.q)
    assert torch.equal(scale, q4.scale.to(torch.bfloat16).float())  # bf16 scales, as torch's
    w = (q.float().view(n, -1, group_size) * scale[..., None] + offset[..., None]).view(n, K)
    tolerance = (
        dict(rtol=2**-8, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    )
    for rows in (1, 7, 64, 2048):
        x = torch.randn(rows, K, generator=gen).to(dtype)
        out = int4_linear(kernels, x, nibbles, sz, n, pairs, amx)
        assert out.shape == (rows, n) and out.dtype == dtype
        expected = F.linear(x.float(), w)
        torch.testing.assert_close(out.float(), expected, **tolerance)
    x = torch.randn(64, K, generator=gen).to(dtype)
    batch = int4_linear(kernels, x, nibbles, sz, n, pairs, amx)
    alone = torch.cat(
        [int4_linear(kernels, x[i : i + 1], nibbles, sz, n, pairs, amx) for i in range(64)]
    )
    assert torch.equal(batch, alone)
    assert torch.equal(int4_linear(kernels, x[:7], nibbles, sz, n, pairs, amx), alone[:7])
    assert torch.equal(int4_linear(kernels, x[:2], nibbles, sz, n, pairs, amx), alone[:2])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(int4_linear(kernels, x, nibbles, sz, n, pairs, amx), batch)
    finally:
        torch.set_num_threads(threads)
    if pairs:
        with pytest.raises(RuntimeError, match="needs bfloat16 x"):
            int4_linear(kernels, x.float(), nibbles, sz, n, pairs, amx)


def test_int4_layouts_are_each_others_transpose() -> None:
    """The same weights in both layouts: the FMA layout's byte c of pair j is channel c's
    columns 2j and 2j + 1; the bf16 dot's puts value v (channel v // 2, column 2j + v % 2) of
    pair j in nibble j % 4 of 16-bit word v of its quad (pairs 4t .. 4t + 3, 64 bytes)."""
    q = torch.arange(32 * 8).remainder(16).view(32, 8).to(torch.uint8)  # channel c: its values
    q[1] = torch.tensor([3, 14, 5, 9, 0, 12, 7, 1], dtype=torch.uint8)
    scale = torch.ones(32, 1)
    fma, fma_sz = pack_int4(q, scale, None, pairs=False)
    dot, dot_sz = pack_int4(q, scale, None, pairs=True)
    assert fma[0, 1, 3].item() == q[3, 2] | (q[3, 3] << 4)  # channel 3, columns 2 and 3
    quad = dot[0, :4].flatten()  # pairs 0-3: words 0-31, little-endian
    assert quad[6].item() == q[1, 1] | (q[1, 3] << 4) == 14 | (9 << 4)  # value 3, pairs 0, 1
    assert quad[7].item() == q[1, 5] | (q[1, 7] << 4) == 12 | (1 << 4)  # value 3, pairs 2, 3
    assert quad[38].item() == q[9, 1] | (q[9, 3] << 4)  # value 19, pairs 0, 1
    assert torch.equal(fma_sz, dot_sz)
    assert torch.equal(unpack_int4(fma, fma_sz, 32, pairs=False)[0], q)
    assert torch.equal(unpack_int4(dot, dot_sz, 32, pairs=True)[0], q)


def test_int4_pairs_need_whole_quads(kernels) -> None:
    """The bf16 dot's int4 layout reads 8 columns at a time: K and the group size must divide
    by 8, refused naming the need (the FMA layout takes any even group)."""
    q = torch.randint(0, 16, (16, 12), dtype=torch.uint8)
    with pytest.raises(ValueError, match="K a multiple of 8"):
        pack_int4(q, torch.ones(16, 3), None, pairs=True)
    if not kernels.bf16_dot():
        return
    nibbles, sz = pack_int4(q[:, :8], torch.ones(16, 2), None, pairs=True)  # groups of 4
    x = torch.randn(1, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="groups of a multiple of 8 columns"):
        int4_linear(kernels, x, nibbles, sz, 16, True, NO_AMX)
    fma, fma_sz = pack_int4(q[:, :8], torch.ones(16, 2), None, pairs=False)
    assert int4_linear(kernels, x, fma, fma_sz, 16, False).shape == (1, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-fma"])
def test_int4_fp32_scales_keep_a_files_values(kernels, dtype: torch.dtype) -> None:
    """GGUF scales (fp16 d times a 6-bit scale for Q4_K) need more bits than bf16: the FMA
    layout takes them in fp32, exactly, and the bf16 dot's layout refuses them."""
    gen = torch.Generator().manual_seed(5)
    n, group_size = 40, 32
    q = torch.randint(0, 16, (n, K), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, K // group_size, generator=gen) * 1e-2).half().float() * 37
    offset = -(torch.rand(n, K // group_size, generator=gen) * 1e-2).half().float() * 11
    assert not torch.equal(scale.to(torch.bfloat16).float(), scale)
    nibbles, sz = pack_int4(q, scale, offset, pairs=False, scale_dtype=torch.float32)
    q_back, scale_back, offset_back = unpack_int4(nibbles, sz, n, pairs=False)
    assert torch.equal(q_back, q) and torch.equal(scale_back, scale)
    assert torch.equal(offset_back, offset)
    w = (q.float().view(n, -1, group_size) * scale[..., None] + offset[..., None]).view(n, K)
    x = torch.randn(33, K, generator=gen).to(dtype)
    out = int4_linear(kernels, x, nibbles, sz, n, False)
    expected = F.linear(x.float(), w)
    # q x scale + sum(x) offset instead of sum(w x): fp32 rounding relative to the largest sums
    atol = float(expected.abs().max()) * (2**-8 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol)
    alone = torch.cat(
        [int4_linear(kernels, x[i : i + 1], nibbles, sz, n, False) for i in range(33)]
    )
    assert torch.equal(out, alone)
    with pytest.raises(RuntimeError, match=r"column pairs needs|float32\) \[N / 16"):
        int4_linear(kernels, x.to(torch.bfloat16), nibbles, sz, n, True)


def test_int8_pairs_interleave_neighbouring_blocks(kernels) -> None:
    """int8's column pairs in panels as int4's quads: block b's pair j at (j * 6 + b) * 32
    bytes in a panel of 6, the last panel (here 1 block of 7) its pairs in order."""
    n, k = 7 * 16, 8
    q = torch.randint(
        -127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3)
    )
    packed, scales = pack_int8(q, torch.ones(n, 1), pairs=True)
    assert packed.shape == (7, k // 2, 16, 2)
    flat = packed.flatten()
    for b in range(7):
        alone = pack_int8(q[16 * b : 16 * b + 16], torch.ones(16, 1), pairs=True)[0].flatten()
        for j in range(k // 2):
            at = (j * 6 + b) * 32 if b < 6 else 6 * 4 * 32 + j * 32
            assert torch.equal(flat[at : at + 32], alone[j * 32 : (j + 1) * 32])
    assert torch.equal(unpack_int8(packed, scales, n)[0], q)
    if kernels.bf16_dot():  # 13 blocks at one row and in a batch: the dequantized product
        gen = torch.Generator().manual_seed(4)
        q8 = torch.randint(-127, 128, (200, 64), dtype=torch.int8, generator=gen)
        scale = torch.rand(200, 1, generator=gen) / 64
        packed, scales = pack_int8(q8, scale, pairs=True)
        x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
        batch = int8_linear(kernels, x, packed, scales, 200, NO_AMX)
        expected = F.linear(x.float(), q8.float() * scale)
        torch.testing.assert_close(batch.float(), expected, rtol=2**-8, atol=2e-3)
        alone = [int8_linear(kernels, x[i : i + 1], packed, scales, 200, NO_AMX) for i in range(9)]
        assert torch.equal(torch.cat(alone), batch)


def test_int4_panels_interleave_neighbouring_blocks(kernels) -> None:
    """A panel's quad t is its blocks' quads t side by side (the last panel may hold fewer
    blocks), in the kernel's panel width: 7 blocks are panels of 6 and 1."""
    assert kernels.panel() == PANEL == 6
    n, k = 7 * 16, 16
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    nibbles, sz = pack_int4(q, torch.ones(n, 1), None, pairs=True)
    flat = nibbles.flatten()
    alone = [pack_int4(q[16 * b : 16 * b + 16], torch.ones(16, 1), None, pairs=True)[0].flatten()
             for b in range(7)]  # fmt: skip
    for b in range(6):  # quad t of block b: 64 bytes at (t * 6 + b) * 64
        for t in range(2):
            assert torch.equal(flat[(t * 6 + b) * 64 : (t * 6 + b + 1) * 64],
                               alone[b][t * 64 : (t + 1) * 64])  # fmt: skip
    assert torch.equal(flat[6 * 128 :], alone[6])  # the last panel: one block, its quads in order
    assert torch.equal(unpack_int4(nibbles, sz, n, pairs=True)[0], q)
    if not kernels.bf16_dot():
        return
    # 13 blocks (panels of 6, 6 and 1), threads splitting them anywhere: the dequantized product
    gen = torch.Generator().manual_seed(2)
    q4 = quantize_int4(torch.randn(200, 64, generator=gen) * 0.05, 32, False)
    nibbles, sz = pack_int4(q4.q, q4.scale, q4.offset, pairs=True)
    q, scale, offset = unpack_int4(nibbles, sz, 200, pairs=True)
    w = (q.float().view(200, 2, 32) * scale[..., None] + offset[..., None]).view(200, 64)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    batch = int4_linear(kernels, x, nibbles, sz, 200, True, NO_AMX)
    torch.testing.assert_close(batch.float(), F.linear(x.float(), w), rtol=2**-8, atol=2e-3)
    threads = torch.get_num_threads()
    for count in (1, 2, 3):
        torch.set_num_threads(count)
        try:
            alone = [int4_linear(kernels, x[i : i + 1], nibbles, sz, 200, True, NO_AMX)
                     for i in range(9)]  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(torch.cat(alone), batch)
