"""Paged decode attention in Triton: one query token per sequence, K/V read in place from the
paged cache, GQA-aware, split-K over long contexts (flash-decoding).

Grid of the main kernel: (decode sequence, KV head, split). A program loads the G query heads
that share its KV head as one [G, D] tile (padded to 16 rows for the tensor cores), so each K/V
tile is read once for all of them. The launch's split count S (the grid's third dimension) is a
runtime argument, at most `MAX_SPLITS`: request i of length L is cut into splits of
c = ceil(L / S) tokens rounded up to the key tile, so it uses its own count ceil(L / c) <= S
(a short sequence in a long batch uses one). A request with one split writes its output
directly; with several, each split writes a partial output and its log-sum-exp, and a second
kernel merges them. Nothing about the split count is a compile-time constant, so a server
compiles each kernel once (the split count is re-chosen every step, and a CUDA graph replays
the grid of its capture).

Deterministic inference (`partition` > 0) does not use this kernel: a request's attention must
not depend on its batch, nor differ from the prefill kernel's at the same position, and this
kernel's split-then-merge (a weighted sum over splits sized by the launch) is a different
order of arithmetic from the prefill kernel's left fold over 256-key partitions
(triton_attention_order). So those decode rows run the prefill kernel as chunks of one token,
on the same code, tiles and warps as a prefill row: walking all partitions in one program per
(request, KV head), or, for a batch too small to fill the GPU, one program per partition and a
left fold of their states (`triton_prefill.ordered_decode_attention`), which gives the same
bits. The cost against split-K: the prefill kernel's larger query tile (up to 128 rows for G
live ones; decode attention is bound by K/V reads) and a partial state per 256 keys.

NOTE: the int32 metadata tensors are views at varying offsets of one packed buffer
(`KernelBatch.build`) and the block table's width changes every step, so the kernels opt out of
Triton's specialisation on their alignment and on the width's value: either would compile a
new variant for some steps.

Reference: `engine.attention.paged_attention` (torch path).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton import next_power_of_2

from duet.engine.kernels.triton_attention_order import PARTITION
from duet.engine.kernels.triton_operands import check_cache_layout, dot_dtype, operand_dtype
from duet.engine.kernels.triton_prefill import ordered_decode_attention

_LOG2E = 1.4426950408889634
MAX_SPLITS = 16
# A split shorter than this costs more in the merge than it gains in parallelism. Two key
# tiles: on the H200 (2026-11-30) a batch-1 step at context 1,024 ran 4 splits of 256 tokens
# under the old bound of 256, 32 programs on 132 SMs walking 8 tiles each, 13.6 us a layer
# (its 4 MB of K/V is 1 us at the HBM bandwidth); 64 gives 16 splits, 128 programs of 2 tiles.
_MIN_TOKENS_PER_SPLIT = 64
# Deterministic inference: the partition of the one order of arithmetic (triton_attention_order).
DETERMINISTIC_PARTITION = PARTITION
# ... split by partition only up to this many (16k tokens): bounds the fp32 partial states a
# CUDA graph holds (rows x partitions; kv_sizing reserves 16 per row for max_num_seqs rows).
MAX_PARTITION_SPLITS = 64
# Arguments whose value or alignment changes from step to step (see the module docstring).
INDEX_PTRS = ["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "decode_indices_ptr"]
RUNTIME_INTS = ["stride_bt", "num_splits"]


@triton.jit
def _request_splits(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """(tokens per split, splits used) of one request, one split for an empty sequence: whole
    key tiles, at most num_splits (the launch's)."""
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    count = tl.where(seq_len > 0, tl.cdiv(seq_len, tl.maximum(split_len, 1)), 1)
    return split_len, count


@triton.jit(do_not_specialize=RUNTIME_INTS, do_not_specialize_on_alignment=INDEX_PTRS)
def _decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    decode_indices_ptr,
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
    num_splits,
    GROUP: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(decode_indices_ptr + slot)
    row = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len, count = _request_splits(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)  # empty for a split past this request's count

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = (
        tl.load(
            query_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        .to(OPERAND_DTYPE)
        .to(DOT_DTYPE)
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < end
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
        s = (
            tl.dot(q, tl.trans(k.to(OPERAND_DTYPE).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            * qk_scale
        )  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(OPERAND_DTYPE).to(DOT_DTYPE),
            v.to(OPERAND_DTYPE).to(DOT_DTYPE),
            input_precision=DOT_PRECISION,
        )
        m_i = m_new

    empty = l_i == 0.0  # an empty sequence (a padded graph row): output 0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if count == 1:
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_mask & (split == 0),
        )
    else:
        # partials: [num_decodes, H, MAX_SPLITS, BLOCK_D] and lse [num_decodes, H, MAX_SPLITS]
        num_heads = tl.num_programs(1) * GROUP
        part = (slot * num_heads + heads) * MAX_SPLITS + split  # [BLOCK_G]
        live = split < count
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=store_mask & live)
        # log2-domain log-sum-exp of this split's scores (every split below count is non-empty)
        lse = m_i + tl.log2(tl.where(empty, 1.0, l_i))
        tl.store(part_lse_ptr + part, lse, mask=g_mask & live)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=INDEX_PTRS)
def _merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    decode_indices_ptr,
    stride_ot,
    stride_oh,
    head_dim,
    num_splits,
    MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    slot = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(decode_indices_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + req)
    _, count = _request_splits(seq_len, num_splits, BLOCK_N)
    if count > 1:  # a request with one split was written by the decode kernel
        row = tl.load(query_start_loc_ptr + req)
        s = tl.arange(0, MAX_SPLITS)
        d = tl.arange(0, BLOCK_D)
        s_mask = s < count
        base = (slot * tl.num_programs(1) + head) * MAX_SPLITS
        lse = tl.load(part_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - m)  # [MAX_SPLITS]
        parts = tl.load(
            part_out_ptr + (base + s)[:, None] * BLOCK_D + d[None, :],
            mask=s_mask[:, None],
            other=0.0,
        )  # [MAX_SPLITS, BLOCK_D]
        o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + d,
            o.to(out_ptr.dtype.element_ty),
            mask=d < head_dim,
        )


@functools.cache
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the launch: enough programs to fill every SM twice, no split shorter than
    64 tokens, at most MAX_SPLITS. A runtime value: any choice reuses the compiled kernels."""
    programs = max(1, num_decodes * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    by_length = -(-max_seq_len // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def choose_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int, deterministic: bool
) -> tuple[int, int]:
    """(the launch's split count, partition): adaptive (`choose_num_splits`, partition 0), or
    for deterministic inference `DETERMINISTIC_PARTITION` and either 1 (each request's one
    program per KV head walks its partitions) or, when that leaves SMs idle (fewer programs
    than twice the SMs) and the longest request has at most `MAX_PARTITION_SPLITS`
    partitions, that count (one program per partition, then a left fold): both give the same
    bits (`ordered_decode_attention`)."""
    if not deterministic:
        return choose_num_splits(num_decodes, num_kv_heads, max_seq_len, num_sms), 0
    parts = max(1, -(-max_seq_len // DETERMINISTIC_PARTITION))
    if num_decodes * num_kv_heads >= 2 * num_sms or parts > MAX_PARTITION_SPLITS:
        return 1, DETERMINISTIC_PARTITION
    return parts, DETERMINISTIC_PARTITION


def decode_launch_config(
    group: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Compile-time parameters of `_decode_kernel`, one set per model and dtype (what
    tests/engine/triton_sm90_compile.py compiles for sm_90, asserting no spills). 32-key tiles
    waste little on the last, partly filled tile of each split. fp32 runs its `tl.dot`s as
    exact FMA loops (no tensor cores), whose operands all sit in registers: 16-key tiles keep
    them there at head_dim 128 (32-key tiles spill)."""
    fp32 = dtype == torch.float32
    return dict(
        GROUP=group,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK_G=max(16, next_power_of_2(group)),  # tl.dot needs 16 rows
        BLOCK_N=16 if fp32 and head_dim > 64 else 32,
        BLOCK_D=next_power_of_2(head_dim),
        OPERAND_DTYPE=operand_dtype(dtype),
        DOT_DTYPE=dot_dtype(dtype, device),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2,
    )


def merge_launch_config(head_dim: int, block_n: int) -> dict[str, Any]:
    """Compile-time parameters of `_merge_kernel`; `block_n`: the decode kernel's BLOCK_N
    (both derive each request's splits from it)."""
    return dict(
        MAX_SPLITS=MAX_SPLITS, BLOCK_N=block_n, BLOCK_D=next_power_of_2(head_dim), num_warps=4
    )


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    decode_indices: torch.Tensor,
    scale: float,
    num_splits: int,
    partition: int = 0,
    tiles: dict[str, int] | None = None,
) -> None:
    """Attention of each decode request's one query token over its whole KV.

    out/query: [T, H, D] (last dim contiguous); kv_cache: [2, num_blocks, block_size, Hkv, D]
    (contiguous); query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks] (int32,
    whole step); decode_indices [Bd]: the requests to serve, whose one token is row
    query_start_loc[i]; num_splits: the launch's split count, 1 to MAX_SPLITS (each request
    uses at most that many); partition: 0, or `DETERMINISTIC_PARTITION` for deterministic
    inference, which runs these rows through the prefill kernel instead, in the order a
    prefill row at the same position follows, on the same tiles (`ordered_decode_attention`;
    num_splits is then 1 or at least the longest request's partition count). Writes those
    rows of `out` only. A request with seq_len 0 gets zeros. `tiles`: BLOCK_N, num_warps or
    num_stages instead of `decode_launch_config`'s (the GPU benchmark's sweep,
    `benchmarks/kernels/decode_splits.py`; each new value compiles a variant)."""
    if partition not in (0, DETERMINISTIC_PARTITION):
        raise ValueError(f"partition must be 0 or {DETERMINISTIC_PARTITION}; got {partition}")
    if partition:
        ordered_decode_attention(
            out, query, kv_cache, query_start_loc, seq_lens, block_tables, decode_indices,
            scale, num_splits,
        )  # fmt: skip
        return
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}")
    num_decodes = decode_indices.shape[0]
    if num_decodes == 0:
        return
    check_cache_layout(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    config = decode_launch_config(num_heads // num_kv_heads, head_dim, kv_cache.dtype, query.device)
    if tiles:
        unknown = set(tiles) - {"BLOCK_N", "num_warps", "num_stages"}
        if unknown:
            raise ValueError(f"tiles: only BLOCK_N, num_warps, num_stages; got {sorted(unknown)}")
        config.update(tiles)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # fp32 partials of the splits; with one split the kernel writes `out` and never touches them
    part_shape = (num_decodes, num_heads, MAX_SPLITS) if num_splits > 1 else (1,)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=out.device)
    part_out = torch.empty(
        (*part_shape, config["BLOCK_D"]) if num_splits > 1 else (1,),
        dtype=torch.float32,
        device=out.device,
    )
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        query_start_loc,
        seq_lens,
        block_tables,
        decode_indices,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        scale * _LOG2E,
        head_dim,
        block_size,
        num_splits,
        **config,
    )
    if num_splits > 1:
        _merge_kernel[(num_decodes, num_heads)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            seq_lens,
            decode_indices,
            out.stride(0),
            out.stride(1),
            head_dim,
            num_splits,
            **merge_launch_config(head_dim, config["BLOCK_N"]),
        )
