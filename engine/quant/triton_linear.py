"""Triton weight-only GEMMs for GPUs: W8A16 (int8 weights) and W4A16 (int4 weights), each with
one scale per output row and group of input columns (`group_size` = K: per channel), int4 with a
zero per group too (w = q * scale + zero).

One kernel serves both formats up to `DEQUANTIZE_ABOVE_ROWS` rows. A program owns a [BM, BN] output tile and a
range of K (split-K: `split_k` programs share one tile's K, each writing fp32 partial sums that a
second kernel adds in a fixed order, so the result does not depend on which program ends first).
It walks its K range `BK` columns at a time, and each `BK` step in sub-chunks of one group at
most: the integer weights go to the activations' dtype exactly (int8 and int4 values are exact
in bf16 and fp16), `tl.dot` multiplies them with fp32 accumulation, and the sub-chunk's sum is
scaled in fp32 (x . (q s + z) = s (x . q) + z sum(x)). No weight tile is dequantized element by
element: the dot sees the raw integers. Per-channel scales multiply once, at the end.

int4 layout (`pack_int4_rows`): [N, K / 2] uint8, column 2j in the low nibble of byte j and
2j + 1 in the high one (not the CPU kernel's blocked layout, engine/quant/formats.py). A packed byte is loaded once
and its two nibbles joined back into column order (`tl.join`), so x is read contiguously.

Launch configurations (`launch_config`) depend on the row count: a decode (16 rows at most)
takes 16 x 32 tiles and 256-column steps and splits K until the grid has a program per SM, since
a GEMV is bound by the weight bytes; up to 128 rows take 64 x 64 tiles; more rows dequantize the
weight (`dequantize`) and call cuBLAS. The CPU tests run these kernels in Triton's interpreter in fp32 (its
bf16 `tl.dot` is wrong) at small shapes with every configuration family; compiled for sm_90 by
tests/engine/quant_sm90_compile.py; run and timed on an H200 by `benchmarks.quantized.gpu`
(docs/quantization.md has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DEQUANTIZE_ABOVE_ROWS = 128
"""More rows than this (a prefill) and the wrappers dequantize the weight to the activations'
dtype for the call and multiply with cuBLAS. On an H200 (docs/quantization.md) the first fused
design ran 2,048 rows at 0.02-0.5x of cuBLAS bf16's speed, this path at 0.36-0.84x."""


@dataclass(frozen=True)
class LaunchConfig:
    """One launch: tile [bm, bn], `bk` columns per step, `split_k` programs per tile."""

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _load_weights(
    q_rows, k0, n_mask, k_hi, EVEN_K: tl.constexpr, INT4: tl.constexpr, COLS: tl.constexpr
):  # fmt: skip
    """Columns [k0, k0 + COLS) of the weight rows `q_rows` as integers [rows, COLS], zero past
    `k_hi`. int4: COLS / 2 bytes a row, the nibbles interleaved back into column order."""
    if INT4:
        half = k0 // 2 + tl.arange(0, COLS // 2)
        if EVEN_K:
            ok = n_mask[:, None]
        else:
            ok = n_mask[:, None] & (2 * half[None, :] < k_hi)
        packed = tl.load(q_rows + half[None, :], mask=ok, other=0)
        low, high = packed & 0xF, packed >> 4
        return tl.reshape(tl.join(low, high), (q_rows.shape[0], COLS))
    cols = k0 + tl.arange(0, COLS)
    if EVEN_K:
        ok = n_mask[:, None]
    else:
        ok = n_mask[:, None] & (cols[None, :] < k_hi)
    return tl.load(q_rows + cols[None, :], mask=ok, other=0)


@triton.jit
def _wq_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, num_groups, k_per_split,
    stride_xm, stride_qn, stride_om, stride_os,
    INT4: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
    PER_CHANNEL: tl.constexpr, SUB: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    q_rows = q_ptr + offs_n[:, None] * stride_qn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    x_total = tl.zeros((BM,), dtype=tl.float32)  # per-channel int4: sum(x) for the zero
    for k0 in range(k_lo, k_hi, BK):
        for j in tl.static_range(BK // SUB):
            kk = k0 + j * SUB
            cols = kk + tl.arange(0, SUB)
            if EVEN_K:
                x_ok = m_mask[:, None]
            else:
                x_ok = m_mask[:, None] & (cols[None, :] < k_hi)
            x = tl.load(x_rows + cols[None, :], mask=x_ok, other=0.0)
            q = _load_weights(q_rows, kk, n_mask, k_hi, EVEN_K, INT4, SUB)
            part = tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=PRECISION)
            if HAS_ZERO:
                x_sum = tl.sum(x.to(tl.float32), 1)
            if PER_CHANNEL:
                acc += part
                if HAS_ZERO:
                    x_total += x_sum
            else:
                group = offs_n * num_groups + kk // GROUP
                if EVEN_K:
                    s_ok = n_mask
                else:  # past K: no group to read
                    s_ok = n_mask & (kk < k_hi)
                scale = tl.load(scale_ptr + group, mask=s_ok, other=0.0).to(tl.float32)
                acc += part * scale[None, :]
                if HAS_ZERO:
                    zero = tl.load(zero_ptr + group, mask=s_ok, other=0.0).to(tl.float32)
                    acc += x_sum[:, None] * zero[None, :]
    if PER_CHANNEL:
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc *= scale[None, :]
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            acc += x_total[:, None] * zero[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if HAS_BIAS:  # only when the program owns the whole K (split_k == 1)
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_k_sum_kernel(
    part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out = sum over splits 0, 1, ... in that order (+ bias), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    total = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, zero_ptr, out_ptr, N, K, num_groups, stride_qn,
    INT4: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """out [N, K] = q * scale (+ zero) per group, in out's dtype."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    n_mask = offs_n < N
    q = _load_weights(q_ptr + offs_n[:, None] * stride_qn, tl.program_id(1) * BK, n_mask, K,
                      False, INT4, BK)  # fmt: skip
    ok = n_mask[:, None] & (cols[None, :] < K)
    group = offs_n[:, None] * num_groups + cols[None, :] // GROUP
    w = q.to(tl.float32) * tl.load(scale_ptr + group, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        w += tl.load(zero_ptr + group, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q ([N, K] in [0, 15], K even) -> [N, K / 2] uint8: column 2j low nibble, 2j + 1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _precision(x: torch.Tensor) -> str:
    """fp32 activations: a full-precision dot (Triton's default on NVIDIA is TF32); bf16/fp16
    multiply on tensor cores with fp32 accumulation either way."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: plan as for an H100, so the CPU tests run split-K too
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def launch_config(
    m: int, n: int, k: int, int4: bool, dtype: torch.dtype, sm_count: int
) -> LaunchConfig:
    """The configuration the wrappers launch for [m, k] x [n, k]: see the module docstring.
    fp32 runs the dot as FMA loops with its operands in registers, so it takes smaller tiles."""
    if dtype == torch.float32:
        bm, bn, bk, warps, stages = 16 if m <= 16 else 32, 32, 32, 4, 3
    elif m <= 16:  # a GEMV: narrow tiles, long steps, deep pipelining
        bm, bn, bk, warps, stages = 16, 32, 256, 4, 4
    else:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 3
    bk = min(bk, max(_pow2_floor(k), 32))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split_k = 1
    # Split K while the grid is under one program per SM and each split keeps 4+ steps.
    while tiles * split_k < sm_count and k // (2 * split_k * bk) >= 4 and split_k < 16:
        split_k *= 2
    return LaunchConfig(bm, bn, bk, split_k, warps, stages)


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def kernel_constexprs(
    cfg: LaunchConfig, m: int, k: int, num_groups: int, int4: bool, has_zero: bool, fp32: bool
) -> dict[str, object]:
    """`_wq_kernel`'s compile-time arguments for `cfg` (HAS_BIAS aside), launch options too."""
    group = k // num_groups
    per_channel = num_groups == 1
    # A sub-chunk lies in one group; the dot needs 16+ columns per operand (int4: per half).
    sub = cfg.bk if per_channel else min(cfg.bk, _pow2_floor(group))
    if not per_channel and group % sub:
        raise ValueError(f"group size {group} is not a multiple of {sub} (a power of two)")
    if sub < (32 if int4 else 16):
        raise ValueError(f"{sub} columns per sub-chunk is under the dot's minimum")
    return dict(
        INT4=int4, HAS_ZERO=has_zero, GROUP=group, PER_CHANNEL=per_channel, SUB=sub,
        EVEN_K=k % cfg.bk == 0,  # every step whole (splits are whole steps)
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PRECISION="ieee" if fp32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    int4: bool,
    config: LaunchConfig | None,
) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    num_groups = scale.shape[1]
    if config is None and m > DEQUANTIZE_ABOVE_ROWS:  # a prefill: cuBLAS on the bf16 weight
        return F.linear(x, dequantize(q, scale, zero, k, int4, x.dtype), bias)
    cfg = config or launch_config(m, n, k, int4, x.dtype, _sm_count(x.device))
    fp32 = x.dtype == torch.float32
    constexprs = kernel_constexprs(cfg, m, k, num_groups, int4, zero is not None, fp32)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.bk), cfg.split_k) * cfg.bk
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = (
        out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(m, cfg.bm), triton.cdiv(n, cfg.bn), split_k)
    fuse_bias = bias is not None and split_k == 1
    _wq_kernel[grid](
        x, q, scale, zero if zero is not None else scale, bias if fuse_bias else scale, target,
        m, n, k, num_groups, k_per_split, x.stride(0), q.stride(0), n, m * n,
        HAS_BIAS=fuse_bias, **constexprs,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else target, out, m * n, n,
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int, int4: bool,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] in `dtype` (w = q * scale + zero), for one product: a fresh buffer
    that torch's allocator hands back to the next layer's call."""
    n, num_groups = q.shape[0], scale.shape[1]
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    bn, bk = 32, 64  # fp16 int4 spilled at 64 x 64 (ptxas, sm_90)
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        q, scale, zero if zero is not None else scale, out, n, k, num_groups, q.stride(0),
        INT4=int4, HAS_ZERO=zero is not None, GROUP=k // num_groups, BN=bn, BK=bk,
    )  # fmt: skip
    return out


def w8a16_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale [N, K / G] per group).T (+ bias) -> [M, N] in x's
    dtype. `config`: a launch configuration instead of `launch_config`'s (benchmarks, tests)."""
    return _launch(x, q.contiguous(), scale.contiguous(), None, bias, q.shape[0], False, config)


def w4a16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias), w = q * scale + zero per group (q from `pack_int4_rows`) ->
    [M, N] in x's dtype."""
    return _launch(
        x, packed.contiguous(), scale.contiguous(), zero.contiguous(), bias, packed.shape[0],
        True, config,
    )  # fmt: skip
