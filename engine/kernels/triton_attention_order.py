"""One order of arithmetic for a query row's attention on the Triton path (deterministic
inference, docs/determinism.md), shared by the prefill and the decode kernels so neither can
drift from the other:

- keys in partitions of `PARTITION` tokens from position 0, each reduced on its own from an
  empty state, then folded into the row's running state strictly left to right, in position
  order (`fold_partition`): pairwise tree merges are not associative bit for bit, a left fold
  is one order whatever cuts the work;
- inside a partition, key tiles of a fixed BLOCK_N (a divisor of `PARTITION`, fixed per model
  and dtype, never derived from a chunk's length or the batch), each one online-softmax step
  (`tile_scores`, then `online_step`).

The state of a row is (m, l, acc): the running maximum score (log2 domain), the sum of
exp2(score - m) and the unnormalised weighted sum of values. Every multiply-add that could be
contracted is written as an explicit `tl.fma`, so the compiler cannot fuse one kernel's
expression differently from the other's.
"""

from __future__ import annotations

import triton
import triton.language as tl

PARTITION = 256
"""Keys per partition (whole blocks of every block size that divides it, and a multiple of every
BLOCK_N the kernels use); the CPU kernels use the same (attention_order.h)."""


@triton.jit
def tile_scores(q, k, qk_scale, OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Log2-domain scores [rows, BLOCK_N] of the query tile against one key tile [BLOCK_N, D]."""
    kt = tl.trans(k.to(OPERAND_DTYPE).to(DOT_DTYPE))
    return tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def online_step(s, v, m_i, l_i, acc, OPERAND_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """(m, l, acc) after one key tile: `s` its masked scores (-inf where not seen), `v` its
    values. A row that has seen no key keeps (-inf, 0, 0) (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = tl.fma(l_i, alpha, tl.sum(p, 1))
    pv = p.to(OPERAND_DTYPE).to(DOT_DTYPE)
    acc = tl.dot(pv, v.to(OPERAND_DTYPE).to(DOT_DTYPE), acc * alpha[:, None],
                 input_precision=DOT_PRECISION)  # fmt: skip
    return m_new, l_new, acc


@triton.jit
def fold_partition(m, l, acc, pm, pl, pacc):  # noqa: E741
    """The running state (m, l, acc) with the next partition's (pm, pl, pacc) folded in.
    Folding into the empty state (-inf, 0, 0) gives the partition's state exactly."""
    m_new = tl.maximum(m, pm)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_safe)
    b = tl.exp2(pm - m_safe)
    l_new = tl.fma(l, a, pl * b)
    acc = tl.fma(acc, a[:, None], pacc * b[:, None])
    return m_new, l_new, acc


@triton.jit
def normalise(l, acc):  # noqa: E741
    """The attention output of a state: acc / l, 0 for a row that saw no key."""
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]
