"""Prefill (extend) attention in Triton over the paged cache: a variable-length batch of query
chunks, each attending to its request's cached context in full and to its own new tokens
causally, so a fresh prompt, a chunk in the middle of a prompt and a prefix-cache hit all run
on this one kernel. K/V (the new tokens' included, already written) are read in place.

Grid: (prefill request, query tile, KV head). A program's [BLOCK_M, D] query tile packs
BLOCK_M // G tokens x the G query heads of its KV head (row r = token r // G, head r % G), so
each K/V tile is loaded once for the whole group. Request i's query rows are
[query_start_loc[i], query_start_loc[i + 1]) of the flat batch; it holds seq_lens[i] tokens
of KV after this step, the last of which are the new ones; query token t sits at position
seq_len - query_len + t and sees keys 0..that position.

Reference: `engine.attention.paged_attention` (torch path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import next_power_of_2

from duet.engine.kernels.triton_attention_order import (
    PARTITION,
    fold_partition,
    normalise,
    online_step,
    tile_scores,
)
from duet.engine.kernels.triton_operands import check_cache_layout, dot_dtype, operand_dtype

_LOG2E = 1.4426950408889634
# Step-to-step variation Triton would otherwise compile a variant for (see triton_decode).
INDEX_PTRS = ["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "prefill_indices_ptr"]


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=INDEX_PTRS)
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    prefill_indices_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    qk_scale,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # SPLIT (deterministic decode, `ordered_decode_attention`): chunks of one token, program
    # (i, p, h) reduces partition p only and writes its state; `_fold_kernel` folds them.
    req = tl.load(prefill_indices_ptr + tl.program_id(0))
    q_tile = 0 if SPLIT else tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    first_token = q_tile * TOKENS_PER_TILE
    r = tl.arange(0, BLOCK_M)
    token = first_token + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < TOKENS_PER_TILE * GROUP) & (token < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = (
        tl.load(
            query_ptr
            + (q_start + token)[:, None] * stride_qt
            + head[:, None] * stride_qh
            + d[None, :],
            mask=q_mask,
            other=0.0,
        )
        .to(OPERAND_DTYPE)
        .to(DOT_DTYPE)
    )  # [BLOCK_M, BLOCK_D]
    q_pos = context_len + token  # [BLOCK_M]

    # Keys below `visible_end` are seen by every row of this tile: no mask needed there.
    visible_end = context_len + first_token
    kv_end = tl.minimum(seq_len, context_len + first_token + TOKENS_PER_TILE)
    kv_end = tl.where(first_token < q_len, kv_end, 0)  # tile past this request's chunk

    # Partitions of PARTITION keys from position 0, each from an empty state, folded left to
    # right (triton_attention_order): the same order for a row whatever its chunk.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    pm = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    pl = tl.zeros([BLOCK_M], dtype=tl.float32)
    pacc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = kv_end
    if SPLIT:
        lo = tl.program_id(1) * PARTITION
        hi = tl.minimum(lo + PARTITION, kv_end)
    for tile in range(lo, hi, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(table + n // block_size, mask=n_mask, other=0)
        kv_off = (
            block[:, None] * stride_cb
            + (n % block_size)[:, None] * stride_cs
            + kv_head * stride_ch
            + d[None, :]
        )  # [BLOCK_N, BLOCK_D]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tile_scores(q, k, qk_scale, OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION)
        if tile + BLOCK_N > visible_end:
            causal = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            s = tl.where(causal, s, float("-inf"))
        pm, pl, pacc = online_step(s, v, pm, pl, pacc, OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION)
        if ((tile + BLOCK_N) % PARTITION == 0) | (tile + BLOCK_N >= kv_end):  # partition done
            m_i, l_i, acc = fold_partition(m_i, l_i, acc, pm, pl, pacc)
            pm = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            pl = tl.zeros([BLOCK_M], dtype=tl.float32)
            pacc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if SPLIT:  # the partition's state (folded into the empty state: exactly itself)
        part = ((tl.program_id(0) * tl.num_programs(2) * GROUP + head) * tl.num_programs(1)
                + tl.program_id(1))  # fmt: skip
        live = row_mask & (lo < kv_end)
        tl.store(part_m_ptr + part, m_i, mask=live)
        tl.store(part_l_ptr + part, l_i, mask=live)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=live[:, None])
    else:
        o = normalise(l_i, acc)
        tl.store(
            out_ptr
            + (q_start + token)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit(do_not_specialize=["max_parts"], do_not_specialize_on_alignment=INDEX_PTRS)
def _fold_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    prefill_indices_ptr,
    stride_ot,
    stride_oh,
    head_dim,
    max_parts,
    BLOCK_D: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """Decode row (program 0) x query head (program 1): its partitions' states folded left to
    right, in position order, with the prefill kernel's `fold_partition`, then normalised."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(prefill_indices_ptr + slot)
    row = tl.load(query_start_loc_ptr + req)
    count = tl.cdiv(tl.load(seq_lens_ptr + req), PARTITION)
    d = tl.arange(0, BLOCK_D)
    zero = tl.zeros([1], dtype=tl.int32)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    base = (slot * tl.num_programs(1) + head) * max_parts
    for p in range(0, count):
        pm = tl.load(part_m_ptr + base + p + zero)
        pl = tl.load(part_l_ptr + base + p + zero)
        pacc = tl.load(part_acc_ptr + (base + p) * BLOCK_D + d)[None, :]
        m_i, l_i, acc = fold_partition(m_i, l_i, acc, pm, pl, pacc)
    o = normalise(l_i, acc)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(d < head_dim)[None, :],
    )


def prefill_launch_config(
    group: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Compile-time parameters of `_prefill_kernel`, one set per model and dtype (what
    tests/engine/triton_sm90_compile.py compiles for sm_90, asserting no spills).
    16-bit on GPUs: a 128-row query tile, 64-key tiles and 8 warps (249 registers at head_dim
    128 in bf16, no spill: the partition's state and the running state are two accumulators;
    176 with one), as in Triton's fused-attention tutorial. fp32 runs its `tl.dot`s as exact
    FMA loops whose operands all sit in registers: 32 x 32 tiles over 8 warps at head_dim <= 128
    (64 x 32 spills 32 bytes with the two accumulators). The interpreter gets 64 rows: the same
    code with less padding on tiny test shapes. Deterministic decode runs this config too."""
    fp32 = dtype == torch.float32
    if device.type != "cuda" or head_dim > 128:
        block_m = 64
    else:
        block_m = 32 if fp32 else 128
    block_m = max(block_m, next_power_of_2(group))
    return dict(
        GROUP=group,
        TOKENS_PER_TILE=block_m // group,
        BLOCK_M=block_m,
        BLOCK_N=32 if fp32 or head_dim > 128 else 64,
        BLOCK_D=next_power_of_2(head_dim),
        OPERAND_DTYPE=operand_dtype(dtype),
        DOT_DTYPE=dot_dtype(dtype, device),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        PARTITION=PARTITION,
        num_warps=8 if block_m >= 128 or fp32 else 4,
        num_stages=2,
    )


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefill_indices: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """Causal attention of each listed request's query chunk over its cached context + itself.

    out/query: [T, H, D] (last dim contiguous); kv_cache: [2, num_blocks, block_size, Hkv, D]
    (contiguous); query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks] (int32,
    whole step); prefill_indices [Bp]: the requests to serve; max_query_len: their longest
    chunk (sizes the grid). Writes those requests' rows of `out` only."""
    num_prefills = prefill_indices.shape[0]
    if num_prefills == 0 or max_query_len == 0:
        return
    _launch(
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, prefill_indices,
        max_query_len, scale, 0,
    )  # fmt: skip


def ordered_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    decode_indices: torch.Tensor,
    scale: float,
    num_partitions: int,
) -> None:
    """Deterministic decode: each listed request's one query token (row query_start_loc[i])
    over its whole KV, bitwise what `paged_prefill_attention` gives that row in any chunk.
    num_partitions 1: one program per (request, KV head) walks the partitions (the prefill
    kernel as one-token chunks). More: at least the longest request's partition count
    (ceil(seq_len / PARTITION)); one program per (request, partition, KV head) reduces one
    partition and `_fold_kernel` folds them left to right: the same arithmetic, in parallel."""
    if decode_indices.shape[0] == 0:
        return
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1; got {num_partitions}")
    _launch(
        out, query, kv_cache, query_start_loc, seq_lens, block_tables, decode_indices, 1,
        scale, num_partitions if num_partitions > 1 else 0,
    )  # fmt: skip


def _launch(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    indices: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_partitions: int,
) -> None:
    """The prefill kernel over `indices`; with num_partitions > 0 (one-token chunks only) split
    by partition, then folded."""
    check_cache_layout(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    config = prefill_launch_config(num_heads // num_kv_heads, head_dim, kv_cache.dtype,
                                   query.device)  # fmt: skip
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    split = num_partitions > 0
    if split:
        grid = (indices.shape[0], num_partitions, num_kv_heads)
        states = (indices.shape[0], num_heads, num_partitions)
        part_m = torch.empty(states, dtype=torch.float32, device=out.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((*states, config["BLOCK_D"]), dtype=torch.float32,
                               device=out.device)  # fmt: skip
    else:
        grid = (indices.shape[0], -(-max_query_len // config["TOKENS_PER_TILE"]), num_kv_heads)
        part_m = part_l = part_acc = out  # unused: SPLIT is off
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, part_m, part_l, part_acc, query_start_loc,
        seq_lens, block_tables, indices, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), scale * _LOG2E, head_dim, block_size, SPLIT=split, **config,
    )  # fmt: skip
    if split:
        _fold_kernel[(indices.shape[0], num_heads)](
            out, part_m, part_l, part_acc, query_start_loc, seq_lens, indices, out.stride(0),
            out.stride(1), head_dim, num_partitions, BLOCK_D=config["BLOCK_D"],
            PARTITION=PARTITION, num_warps=4,
        )  # fmt: skip
