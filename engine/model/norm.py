"""`RMSNorm`: HF's LlamaRMSNorm, on duet's CPU kernel or the Triton ones where they apply."""

from __future__ import annotations

import torch
from torch import nn

from duet.engine.kernels import fused_ops_for


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm. On the CPU a C++ kernel does it in one pass (engine/kernels/), on
    CUDA a Triton kernel (engine/kernels/triton_elementwise.py), each fused with the residual
    add before it in `add_and_norm`; on CUDA also Qwen3's per-head q/k norms. Otherwise
    torch's path (on CUDA with `invariant` set, deterministic inference, the Triton norm)."""

    invariant: bool = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # CUDA's Triton norm takes any leading dims (Qwen3's per-head q/k norms); the CPU's, rows
        kernels = fused_ops_for(x) if x.stride(-1) == 1 and (x.dim() == 2 or x.is_cuda) else None
        if kernels is not None:
            return kernels.rms_norm(x, self._parameters["weight"], self.eps)
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): HF's residual add and the next norm. On the
        CPU kernel path x and residual are overwritten with them (no allocation)."""
        kernels = fused_ops_for(x) if x.dim() == 2 else None
        if kernels is not None and x.is_contiguous() and residual.is_contiguous():
            kernels.fused_add_rms_norm(x, residual, self._parameters["weight"], self.eps)
            return x, residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and x.is_cuda:
            from duet.engine.kernels.triton_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 and scale in the input dtype, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
