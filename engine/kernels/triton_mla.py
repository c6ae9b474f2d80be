"""Multi-head latent attention (DeepSeek-V2/V3) in Triton, over the paged cache of compressed
entries, in the absorbed form (engine/model/latent_attention.py): each head's query is
[q_abs | q_pe], its score against a token q_abs . c + q_pe . k_pe, its value the latent c.

Grid: (request, query token of the request, tile of BLOCK_H heads). A program computes one
query row for BLOCK_H heads: the row's latent and roped parts as two [BLOCK_H, D] tiles, then
every key the row sees (positions 0 .. its own), BLOCK_N entries at a time in position order,
each tile one online-softmax step (triton_attention_order's `online_step`, whose `tl.dot` takes
the entries' latent part as the values). The heads share each entry tile, which is the point of
MLA: one [BLOCK_N, 576] read serves all of them.

The row's arithmetic depends only on its own position, its query and the cache: not on the
batch, on the other rows of its chunk, or on whether it is a decode or a prefill row, so the
kernel is batch-invariant by construction and a token computes the same bits chunked or
decoded (docs/determinism.md), with no split and no merge. The price: one program per row and
head tile walks the whole context, so a single long decode fills few SMs (DeepSeek-V3's 128
heads in 16-head tiles: 8 programs per sequence), and a prefill row re-reads the entries every
other row of its chunk reads. Split-K decode and query tiles for prefill are the next step.

Reference: `latent_attention.latent_attention` (the torch path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import next_power_of_2

from duet.engine.kernels.triton_attention_order import normalise, online_step
from duet.engine.kernels.triton_operands import check_cache_layout, dot_dtype, operand_dtype

_LOG2E = 1.4426950408889634
INDEX_PTRS = ["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"]
RUNTIME_INTS = ["stride_bt"]


@triton.jit(do_not_specialize=RUNTIME_INTS, do_not_specialize_on_alignment=INDEX_PTRS)
def _mla_kernel(
    query_ptr,
    cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    qk_scale,
    num_heads,
    latent_size,
    rope_size,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    head_tile = tl.program_id(2)
    row_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - row_start
    if j >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    row = row_start + j
    pos = seq_len - query_len + j  # the row sees keys 0 .. pos

    h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_L)
    r = tl.arange(0, BLOCK_R)
    h_mask = h < num_heads
    c_mask = c < latent_size
    r_mask = r < rope_size
    q_row = query_ptr + row.to(tl.int64) * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(q_row + c[None, :], mask=h_mask[:, None] & c_mask[None, :], other=0.0)
    q_pe = tl.load(
        q_row + latent_size + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0
    )
    q_lat = q_lat.to(OPERAND_DTYPE).to(DOT_DTYPE)
    q_pe = q_pe.to(OPERAND_DTYPE).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        seen = n <= pos
        block = tl.load(table + n // block_size, mask=seen, other=0).to(tl.int64)
        entry = cache_ptr + block[:, None] * stride_cb + (n % block_size)[:, None] * stride_cs
        k_lat = tl.load(entry + c[None, :], mask=seen[:, None] & c_mask[None, :], other=0.0)
        k_pe = tl.load(
            entry + latent_size + r[None, :], mask=seen[:, None] & r_mask[None, :], other=0.0
        )
        k_lat = k_lat.to(OPERAND_DTYPE).to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe.to(OPERAND_DTYPE).to(DOT_DTYPE)), s,
                   input_precision=DOT_PRECISION)  # fmt: skip
        s = tl.where(seen[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = online_step(
            s, k_lat, m_i, l_i, acc, OPERAND_DTYPE, DOT_DTYPE, DOT_PRECISION
        )
    o = normalise(l_i, acc)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + h[:, None] * stride_oh + c[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & c_mask[None, :],
    )


def mla_launch_config(
    latent_size: int, rope_size: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Compile-time parameters of `_mla_kernel`, one set per model and dtype (what
    tests/engine/triton_sm90_compile.py compiles for sm_90): 16 heads a tile (`tl.dot`'s
    smallest row count), 16 entries a key tile in fp32 and 32 in 16-bit (the [16, 512]
    accumulator and a [32, 576] entry tile over 4 warps), as vLLM's Triton MLA decode picks."""
    fp32 = dtype == torch.float32
    return dict(
        BLOCK_H=16,
        BLOCK_N=16 if fp32 else 32,
        BLOCK_L=next_power_of_2(latent_size),
        BLOCK_R=max(16, next_power_of_2(rope_size)),
        OPERAND_DTYPE=operand_dtype(dtype),
        DOT_DTYPE=dot_dtype(dtype, device),
        DOT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=8 if fp32 else 4,
        num_stages=2,
    )


def mla_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """Causal latent attention of every request's query rows over its cached entries (this
    step's written already): out [T, H, latent] (the latent results), query [T, H, latent +
    rope] (last dim contiguous), cache [1, num_blocks, block_size, 1, latent + rope]
    (contiguous); query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks] (int32,
    the whole step); max_query_len: the longest request's query rows (sizes the grid)."""
    check_cache_layout(cache)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return
    latent_size = out.shape[-1]
    rope_size = cache.shape[-1] - latent_size
    if query.shape[-1] != cache.shape[-1] or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"query [T, H, {cache.shape[-1]}] and out [T, H, latent] with the last dim "
            f"contiguous; got {tuple(query.shape)} and {tuple(out.shape)}"
        )
    num_heads = query.shape[1]
    config = mla_launch_config(latent_size, rope_size, cache.dtype, query.device)
    plane = cache[0]  # [num_blocks, block_size, 1, width]
    grid = (num_reqs, max_query_len, triton.cdiv(num_heads, config["BLOCK_H"]))
    _mla_kernel[grid](
        query, plane, out, query_start_loc, seq_lens, block_tables, query.stride(0),
        query.stride(1), out.stride(0), out.stride(1), plane.stride(0), plane.stride(1),
        block_tables.stride(0), scale * _LOG2E, num_heads, latent_size, rope_size,
        plane.shape[1], **config,
    )  # fmt: skip
