"""A fused mixture-of-experts feed-forward for CUDA: every expert's gate|up and down products in
two kernel launches, with no host sync (so a CUDA graph could hold it). The loader puts every
sparse layer on it on CUDA (`moe.fuse_moe_experts`); under the expert exchange an owner runs its
received rows through it (`expert_rows`). Checked in the Triton interpreter against the torch
path (`engine/model/moe.py`); not yet run on a GPU.

The layout is vLLM's fused_moe's: a step's (token, choice) slots are sorted by expert and each
expert's run is padded to a whole number of BLOCK_M-row blocks (`align_by_expert`, torch ops on
the device, sized for the worst case so nothing comes back to the host); a program computes one
block's BLOCK_N output columns with its expert's weight, gathering its rows by slot, and writes
them back at their slot. Padding rows are masked.

Batch invariance (deterministic inference): like `triton_matmul`, one tile configuration per
dtype (`moe_config`), no split-K, each output element one program's sequential walk over K in
BLOCK_K steps: a row's bits do not depend on the other rows of its block, nor on which block or
row of a block it lands in. The routing weight scales a row after its product is rounded to the
model's dtype, as the torch path does (in fp32 for Mixtral, in the model's dtype for Qwen).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from duet.engine.kernels.triton_operands import dot_dtype, operand_dtype

_RUNTIME_INTS = ["num_slots"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _expert_matmul_kernel(
    a_ptr,  # [rows, K]: the tokens (GATHER: a slot's row is slot // TOP_K) or one row per slot
    w_ptr,  # [E, N, K]
    out_ptr,  # [num_slots, N], a row per slot
    scale_ptr,  # [num_slots] fp32: the slots' routing weights (SCALE)
    sorted_slots_ptr,  # [num_blocks * BLOCK_M] int32: slots by expert, padding = num_slots
    block_expert_ptr,  # [num_blocks] int32: each block's expert, -1 for none
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_IN_MODEL_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = (slots < num_slots) & (expert >= 0)
    expert = tl.maximum(expert, 0).to(tl.int64)
    if GATHER:
        a_rows = slots // TOP_K
    else:
        a_rows = slots
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_row_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    w_col_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_mask = k < K
        a = tl.load(a_row_ptrs + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_col_ptrs + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(
            a.to(OPERAND_DTYPE).to(DOT_DTYPE),
            tl.trans(w.to(OPERAND_DTYPE).to(DOT_DTYPE)),
            acc,
            input_precision=DOT_PRECISION,
        )
    # The product's one rounding, as a linear's; the scaling in fp32 on the rounded values (a
    # 16-bit product of 16-bit values is exact in fp32, so rounding it once at the store is
    # the 16-bit multiply; the interpreter's own 16-bit arithmetic is wrong, like its tl.dot).
    out = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    if SCALE:
        scale = tl.load(scale_ptr + slots, mask=row_mask, other=0.0)
        if SCALE_IN_MODEL_DTYPE:
            scale = scale.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = out * scale[:, None]
    tl.store(
        out_ptr + slots.to(tl.int64)[:, None] * stride_om + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def moe_config(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The one tile configuration of a dtype, as `triton_matmul.matmul_config`'s."""
    fp32 = dtype == torch.float32
    return dict(
        BLOCK_M=32 if fp32 else 64,
        BLOCK_N=64,
        BLOCK_K=32 if fp32 else 64,
        OPERAND_DTYPE=operand_dtype(dtype),
        DOT_DTYPE=dot_dtype(dtype, device),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2 if fp32 else 3,
    )


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots [num_blocks * block_m] int32, block_expert [num_blocks] int32) for expert
    ids [T, k]: the slots (token * k + choice) grouped by expert in slot order, each expert's
    run padded with `T * k` to whole blocks; each block's expert (-1 past the last). Sized for
    the worst case (every expert's run padded), computed on the device without a host sync.

    Expert parallelism: the ids are the model's, this rank holds `num_experts` of them from
    `first_expert` (the block's local index is id - first_expert); a slot routed to another
    rank's expert goes into a last run whose blocks say -1, so no program computes it."""
    flat = ids.reshape(-1).to(torch.int64) - first_expert
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_slots = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)  # + other ranks
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    run_start = counts.cumsum(0) - counts
    expert_of = flat.index_select(0, order)  # [slots], ascending
    rank = torch.arange(num_slots, device=device) - run_start.index_select(0, expert_of)
    position = (padded_end - padded).index_select(0, expert_of) + rank
    num_blocks = (num_slots + (num_experts + 1) * (block_m - 1) + block_m - 1) // block_m
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.index_copy_(0, position, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


def fused_experts(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 I, hidden]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, hidden, I]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k], ascending per row
    weights_in_model_dtype: bool,
    first_expert: int = 0,
    local: bool = False,
) -> torch.Tensor:
    """What `moe.grouped_experts` computes, in two launches: [T, hidden] in x's dtype. With
    expert parallelism (`local`), w13 and w2 hold this rank's experts from `first_expert`, and
    the slots routed to the others add zeros (their ranks add the products)."""
    num_tokens, top_k = ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_slots = num_tokens * top_k
    config = moe_config(x.dtype, x.device)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    sorted_slots, block_expert = align_by_expert(ids, num_experts, block_m, first_expert)
    num_blocks = block_expert.numel()
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    x = x.contiguous()
    gate_up = torch.empty(num_slots, two_i, dtype=x.dtype, device=x.device)
    _expert_matmul_kernel[(num_blocks, triton.cdiv(two_i, block_n))](
        x, w13, gate_up, scale, sorted_slots, block_expert, num_slots, two_i, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), gate_up.stride(0),
        TOP_K=top_k, GATHER=True, SCALE=False, SCALE_IN_MODEL_DTYPE=False, **config,
    )  # fmt: skip
    gate, up = gate_up.split(inter, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()  # [slots, I]
    make = torch.zeros if local else torch.empty  # no program writes another rank's slots
    out = make(num_slots, hidden, dtype=x.dtype, device=x.device)
    _expert_matmul_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2, out, scale, sorted_slots, block_expert, num_slots, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, GATHER=False, SCALE=True, SCALE_IN_MODEL_DTYPE=weights_in_model_dtype,
        **config,
    )  # fmt: skip
    per_choice = out.view(num_tokens, top_k, hidden)
    total = per_choice[:, 0]
    for k in range(1, top_k):  # in expert order, as moe.grouped_experts
        total = total + per_choice[:, k]
    return total


def expert_rows(
    rows: torch.Tensor,  # [R, hidden], grouped by expert: counts[e] rows for local expert e
    w13: torch.Tensor,
    w2: torch.Tensor,
    counts: list[int],
) -> torch.Tensor:
    """Each row through its expert, unscaled, [R, hidden] in the rows' dtype: what an owner
    computes for the rows the expert exchange brought it (engine/model/moe_exchange.py), as
    `fused_experts` with one choice of weight 1 per row (the scaling exact: the caller scales
    and adds as `fused_experts` would have)."""
    if rows.shape[0] == 0:
        return rows.new_empty((0, w2.shape[1]))
    device = rows.device
    ids = torch.repeat_interleave(
        torch.arange(len(counts), device=device), torch.tensor(counts, device=device)
    ).view(-1, 1)
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=device)
    return fused_experts(rows, w13, w2, ones, ids, False)
