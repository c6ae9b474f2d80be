"""GGUF quantized tensors repacked into duet's formats (engine/quant/formats.py), exactly.

Each ggml block type is read with numpy views of the memory-mapped file, one tensor at a time:

| ggml type | block | duet format |
| --- | --- | --- |
| Q8_0 | 32 int8, an fp16 scale | `Int8Weight`, groups of 32 |
| Q6_K | 256 6-bit values in 16 groups, int8 group scales times an fp16 scale | `Int8Weight`, groups of 16 |
| Q4_0 | 32 nibbles, an fp16 scale; w = d (q - 8) | symmetric `Int4Weight`, groups of 32 |
| Q4_1 | 32 nibbles, fp16 scale d and minimum m; w = d q + m | asymmetric `Int4Weight`, groups of 32 |
| Q4_K | 256 nibbles in 8 groups, 6-bit scales and minimums of two fp16s | asymmetric `Int4Weight`, groups of 32 |

Scales are computed in fp32 exactly as `gguf.quants.dequantize` computes them, so `dequantize()`
of a repacked tensor equals gguf's bit for bit (tests/engine/test_gguf_repack.py).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from duet.engine.quant.formats import Int4Weight, Int8Weight, QuantizedWeight

Q = gguf.GGMLQuantizationType
REPACKED_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K})
QK_K = 256


def repack(data: np.ndarray, qtype: Q) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([N, bytes per row] uint8) as a duet format ([N, K])."""
    rows = data.shape[0]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, type_size)  # [N, K / block, bytes]
    if qtype == Q.Q8_0:
        return _q8_0(blocks)
    if qtype == Q.Q4_0 or qtype == Q.Q4_1:
        return _q4_0_or_1(blocks, with_min=qtype == Q.Q4_1)
    if qtype == Q.Q4_K:
        return _q4_k(blocks)
    if qtype == Q.Q6_K:
        return _q6_k(blocks)
    raise ValueError(
        f"{qtype.name} is not repacked; supported: {sorted(t.name for t in REPACKED_TYPES)}"
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes ([..., 2] uint8) as fp32 ([...])."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q8_0(blocks: np.ndarray) -> Int8Weight:
    rows, num_blocks, _ = blocks.shape
    scale = _f16(blocks[..., :2])  # [N, K / 32]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, num_blocks * 32)
    return Int8Weight(torch.from_numpy(q.copy()), torch.from_numpy(scale), 32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., B] -> nibbles [..., 2B]: every low nibble first, then every high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0_or_1(blocks: np.ndarray, with_min: bool) -> Int4Weight:
    rows, num_blocks, _ = blocks.shape
    scale = _f16(blocks[..., :2])
    start = 4 if with_min else 2
    q = _low_high(blocks[..., start:]).reshape(rows, num_blocks * 32)
    offset = torch.from_numpy(_f16(blocks[..., 2:4])) if with_min else None
    return Int4Weight(torch.from_numpy(q.copy()), torch.from_numpy(scale), offset, 32)


def _q4_k(blocks: np.ndarray) -> Int4Weight:
    rows, num_blocks, _ = blocks.shape
    flat = blocks.reshape(rows * num_blocks, -1)
    d, dmin = _f16(flat[:, 0:2]), _f16(flat[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16])  # [blocks, 8] each
    scale = d[:, None] * sc.astype(np.float32)  # as gguf: (d * sc)
    offset = -(dmin[:, None] * m.astype(np.float32))  # gguf subtracts (dmin * m)
    qs = flat[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: groups 2c (low), 2c + 1 (high)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(rows, num_blocks * QK_K)
    return Int4Weight(
        torch.from_numpy(q.copy()),
        torch.from_numpy(scale.reshape(rows, num_blocks * 8)),
        torch.from_numpy(offset.reshape(rows, num_blocks * 8)),
        32,
    )


def _q6_k(blocks: np.ndarray) -> Int8Weight:
    rows, num_blocks, _ = blocks.shape
    flat = blocks.reshape(rows * num_blocks, -1)
    n = flat.shape[0]
    ql, qh = flat[:, :128], flat[:, 128:192]
    scales = np.ascontiguousarray(flat[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(flat[:, 208:210])
    scale = d[:, None] * scales  # as gguf: (d * scales), [blocks, 16]
    # The same bit gathering as gguf.quants.Q6_K.dequantize_blocks.
    low = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(n, -1, 32)
    high = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, -1, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return Int8Weight(
        torch.from_numpy(q.reshape(rows, num_blocks * QK_K)),
        torch.from_numpy(scale.reshape(rows, num_blocks * 16)),
        16,
    )
