"""What a loaded model's weights take in memory, counted once each: parameters, quantized
weights with their scales, and the packed copies some layers keep (docs/quantization.md)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from duet.engine.model.quantized_linear import QuantizedLinear
from duet.engine.quant.config import QuantizationConfig

logger = logging.getLogger(__name__)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(all weight bytes, the quantized layers' share) of `model`: parameters, quantized
    weights with their scales, and a tied LM head's own copy when it has one."""
    seen: set[int] = set()
    total = quantized = 0
    for module in model.modules():
        tensors: list[torch.Tensor] = list(module.parameters(recurse=False))
        if isinstance(module, QuantizedLinear):
            quantized += module.weight_bytes()
            tensors += list(module.buffers(recurse=False))
        elif isinstance(getattr(module, "packed", None), torch.Tensor):
            tensors.append(module.packed)  # type: ignore[arg-type]  # PackedLinear's oneDNN copy
            if isinstance(getattr(module, "bias", None), torch.Tensor):
                tensors.append(module.bias)  # type: ignore[arg-type]  # and its bias, a buffer
        elif isinstance(getattr(module, "cpu_kernel_panels", None), torch.Tensor):
            tensors.append(module.cpu_kernel_panels)  # type: ignore[arg-type]  # a tied head's
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes
    return total, quantized


def log_weight_bytes(model: nn.Module, name: str, config: QuantizationConfig | None) -> int:
    """Log the weight bytes at load (and the quantized layers' share); returns the total."""
    total, quantized = weight_bytes(model)
    mib = 1 << 20
    if config is None:
        logger.info("%s: weights %.1f MiB", name, total / mib)
    else:
        logger.info(
            "%s: weights %.1f MiB, of which %.1f MiB %s linears",
            name, total / mib, quantized / mib, config.describe(),
        )  # fmt: skip
    return total
