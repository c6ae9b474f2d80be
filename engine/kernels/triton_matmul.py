"""A batch-invariant matrix product for CUDA (deterministic inference, docs/determinism.md):
out = x @ w.T (+ bias), for the model's linears and LM head.

cuBLAS picks its kernel, tiles and split-K from the shape, so a row's bits depend on how many
rows share the product. Here every product of a model and dtype runs one compiled kernel
with one tile configuration (`matmul_config`: fixed per dtype, never derived from M), no
split-K: each output element is one program's sequential walk over K in BLOCK_K steps, the
same walk whether x has 1 row or 2,048, and whatever row of its tile it lands in.

Grid: one program per (BLOCK_M x BLOCK_N) output tile, M-tiles grouped by GROUP_M for L2
reuse of w (the order programs run in changes no value). The interpreter multiplies in fp32
after rounding operands to the input dtype (triton_operands.dot_dtype), as the attention
kernels do.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from duet.engine.kernels.triton_operands import dot_dtype, operand_dtype

# Arguments whose value changes with the batch: M must not compile a variant per batch size.
_RUNTIME_INTS = ["M"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_m
    tile_n = (pid % per_group) // group_m

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(
            x.to(OPERAND_DTYPE).to(DOT_DTYPE),
            tl.trans(w.to(OPERAND_DTYPE).to(DOT_DTYPE)),
            acc,
            input_precision=DOT_PRECISION,
        )
    if HAS_BIAS:  # added in fp32 before the one rounding, as cuBLAS's epilogue does
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def matmul_config(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The one tile configuration of a dtype (what tests/engine/triton_sm90_compile.py compiles
    for sm_90). 16-bit: 64 x 64 output tiles over 64-wide K steps, 4 warps, 3 stages. fp32 runs
    `tl.dot` as exact FMA loops with operands in registers: 32 x 64 tiles over 32-wide K."""
    fp32 = dtype == torch.float32
    return dict(
        BLOCK_M=32 if fp32 else 64,
        BLOCK_N=64,
        BLOCK_K=32 if fp32 else 64,
        GROUP_M=8,
        OPERAND_DTYPE=operand_dtype(dtype),
        DOT_DTYPE=dot_dtype(dtype, device),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2 if fp32 else 3,
    )


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) in x's dtype, each row's bits independent of M.
    x and weight need a contiguous last dimension; float32, bfloat16 or float16."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype; got {x.dtype}, {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    config = matmul_config(x.dtype, x.device)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else out, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, **config,
    )  # fmt: skip
    return out
