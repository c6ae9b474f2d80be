"""Triton weight-only GEMMs for GPUs: W8A16 (int8 weights) and W4A16 (int4 weights), each with
one scale per output row and group of input columns (`group_size` = K: per channel).

The weight tile is dequantized in registers (int -> fp32, times its scale, plus its zero for
int4, rounded to the activations' dtype) and multiplied with `tl.dot`, accumulating in fp32. Activations are bf16/fp16 on a GPU;
the CPU tests run these kernels in Triton's interpreter in fp32 only (its bf16 `tl.dot` is
wrong), at tiny shapes, against the dequantized reference (tests/engine/test_quantized_triton.py).

int4 layout here (`pack_int4_rows`): [N, K / 2] uint8, column 2j in the low nibble of byte j and
2j + 1 in the high one; not the CPU kernel's blocked layout (engine/quant/formats.py).
Not yet run on a GPU: no numbers are claimed for these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _w8a16_kernel(
    x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, num_groups,
    stride_xm, stride_qn, stride_om,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=w_mask, other=0)
        scale_index = offs_n[:, None] * num_groups + offs_k[None, :] // GROUP
        scale = tl.load(scale_ptr + scale_index, mask=w_mask, other=0.0)
        w = (q.to(tl.float32) * scale.to(tl.float32)).to(x.dtype)  # [BN, BK]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w4a16_kernel(
    x_ptr, q_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, num_groups,
    stride_xm, stride_qn, stride_om,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        packed = tl.load(
            q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=w_mask, other=0
        )
        q = (packed.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF
        group = offs_n[:, None] * num_groups + offs_k[None, :] // GROUP
        scale = tl.load(scale_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * scale + zero).to(x.dtype)  # [BN, BK]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """q ([N, K] in [0, 15], K even) -> [N, K / 2] uint8: column 2j low nibble, 2j + 1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _precision(x: torch.Tensor) -> str:
    """fp32 activations: a full-precision dot (Triton's default on NVIDIA is TF32); bf16/fp16
    multiply on tensor cores with fp32 accumulation either way."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def w8a16_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale [N, K / G] per group).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    num_groups = scale.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    x, q, scale = x.contiguous(), q.contiguous(), scale.contiguous()
    _w8a16_kernel[_grid(m, n)](
        x, q, scale, out, m, n, k, num_groups, x.stride(0), q.stride(0), out.stride(0),
        GROUP=k // num_groups, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, PRECISION=_precision(x),
    )  # fmt: skip
    return out


def w4a16_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """x [M, K] @ w.T, w = q * scale + zero per group (q from `pack_int4_rows`) -> [M, N]."""
    m, k = x.shape
    n = packed.shape[0]
    num_groups = scale.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    x, packed, scale, zero = (
        x.contiguous(),
        packed.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
    )
    _w4a16_kernel[_grid(m, n)](
        x, packed, scale, zero, out, m, n, k, num_groups, x.stride(0), packed.stride(0),
        out.stride(0), GROUP=k // num_groups, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        PRECISION=_precision(x),
    )  # fmt: skip
    return out
