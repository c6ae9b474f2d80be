"""Compute kernels: CPU C++ (built on first use) and, for the GPU path, Triton."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from duet.engine.kernels.cpu import kernels_for

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_ops_for(x: torch.Tensor) -> Any | None:
    """What runs a decoder layer's small fused operators (`rms_norm`, `fused_add_rms_norm`,
    `rotary_embedding`, `silu_and_mul`) on `x`'s device: the CPU kernels (kernels_for), the
    Triton ones on CUDA (triton_elementwise.py), or None (the caller's torch path)."""
    if x.is_cuda:  # (is_cuda and is_cpu: no torch.device object made, as x.device makes one)
        return _triton_elementwise() if x.dtype in TRITON_DTYPES else None
    return kernels_for(x)


_TRITON: list[ModuleType] = []


def _triton_elementwise() -> ModuleType:
    if not _TRITON:  # imported on first use: Triton's import is slow and CPU-only runs skip it
        from duet.engine.kernels import triton_elementwise

        _TRITON.append(triton_elementwise)
    return _TRITON[0]
