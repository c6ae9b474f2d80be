"""A batch-invariant RMSNorm for CUDA (deterministic inference, docs/determinism.md).

torch's CUDA reduction picks its block shape, and whether threads or blocks share one row's
sum, from the number of rows, so `x.pow(2).mean(-1)` need not give a row the same bits alone
as in a batch. Here one program normalises one row with one fixed reduction (the whole row in
one tile of the next power of two of its width, fixed per model), whatever the row count.
Numerics as HF's LlamaRMSNorm: normalise in fp32, round to the input dtype, scale by the
weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, 0) / width
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` ([..., D], last dim contiguous) over its last dim, scaled by `weight`
    ([D], x's dtype); each row's bits independent of how many rows there are."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"weight must be [{width}]; got {tuple(weight.shape)}")
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), width, eps, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out.view(x.shape)
