"""Linear layers with their weights reordered once into oneDNN's blocked layout (CPU).

bf16: torch's eager `F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight,
which oneDNN reorders into its blocked layout (for AMX / AVX512-BF16 tiles) on every call.
Doing that once at load time makes a decode step's projections 1.5-2x faster (batches of 1-128
rows, SmolLM2's shapes, 2 threads on AVX512-BF16 + AMX) with bit-identical results; at 2048
rows the two are within 5%.

fp32 on AMD CPUs: `F.linear` goes to MKL, which there copies the weight into its panel layout
on every call (`sgemm_scopy_*`, 17% of a decode-heavy run's time). oneDNN's packed weight
makes SmolLM2's projections 1.1-2.1x faster at 8-64 rows and the LM head 1.4-2.9x, within
+-25% at 1 row and 9-17% slower at 2048 rows (a long prefill chunk); the offline benchmark
gained 8% (2-core EPYC, 2 threads). On Intel CPUs MKL has no such cost and an earlier
measurement found the packed path slower for single rows, so fp32 stays plain there
(`DUET_PACK_FP32=1` or `0` overrides the choice). Since 2026-11-29 the loader puts fp32 layers
on duet's own dense kernel first wherever it builds (faster than both at one row:
engine/model/dense_cpu_linear.py), so this fp32 path serves only without that kernel, or when
`DUET_PACK_FP32=1` asks for it.

The packed weight replaces the plain one, so memory does not grow, except for a tied LM head
(the embedding keeps the plain table).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from duet.engine.config import cpu_has_native_bf16, cpu_vendor
from duet.engine.cpu_runtime import release_freed_memory
from duet.engine.model.row_invariant import MIN_ROWS, linear_rows

logger = logging.getLogger(__name__)


def fp32_packing_forced() -> bool:
    """`DUET_PACK_FP32=1`: fp32 layers take oneDNN's packed path even where duet's dense kernel
    would serve them (the loader's default, engine/model/dense_cpu_linear.py)."""
    return os.environ.get("DUET_PACK_FP32") == "1"


@functools.cache
def packing_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU and torch build take the packed path for `dtype`: bf16 needs native bf16
    (AVX512-BF16 or AMX; elsewhere oneDNN refuses the bf16 reorder or emulates it slowly), fp32
    an AMD CPU (see above), both oneDNN's ops."""
    if dtype == torch.bfloat16:
        wanted = cpu_has_native_bf16()
    elif dtype == torch.float32:
        choice = os.environ.get("DUET_PACK_FP32", "auto")
        wanted = choice == "1" or (choice == "auto" and cpu_vendor() == "AuthenticAMD")
    else:
        wanted = False
    if not (
        wanted
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as e:
        logger.info("oneDNN %s weight packing unavailable here (%s); using F.linear", dtype, e)
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` (a CPU [out, in] matrix) takes the packed path here."""
    return weight.device.type == "cpu" and packing_supported(weight.dtype)


class PackedLinear(nn.Module):
    """`y = x @ W.T (+ b)` with W held in oneDNN's layout. Build with `from_weight`."""

    def __init__(
        self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        return cls(
            packed, None if bias is None else bias.detach(), weight.shape[1], weight.shape[0]
        )

    min_rows: int = MIN_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # At least min_rows rows, so a row's bits do not depend on the batch (row_invariant.py).
        return linear_rows(x, self._product, self.min_rows)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # `self.packed` is a Python call (nn.Module.__getattr__)
        return torch.ops.mkldnn._linear_pointwise(
            rows, buffers["packed"], buffers["bias"], "none", [], ""
        )


def pack_linears(model: nn.Module) -> int:
    """Replace every packable `nn.Linear` under `model` by a `PackedLinear`; returns how many.
    Any failure leaves the remaining layers as they are (the plain path computes the same)."""
    # NOTE: (parent, name) pairs, not the layers: a list of the layers (or of `modules()`)
    # would keep every plain weight alive until the last is packed, doubling the model's
    # memory at load time. This way each plain weight is freed as its packed copy replaces it.
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and can_pack(child.weight)
        and getattr(child, "cpu_kernel", None) is None  # not on duet's dense kernel already
    ]
    count = 0
    for parent, name in targets:
        child = getattr(parent, name)
        try:
            packed = PackedLinear.from_weight(child.weight, child.bias)
        except RuntimeError as e:  # an unusual build of torch: keep the plain layers
            logger.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
            return count
        del child
        setattr(parent, name, packed)
        # The CPU engine keeps freed memory in the heap (engine/cpu_runtime.py); the packed
        # copies rarely fit the plain weights' holes, so without this the heap held up to
        # ~15% of a 1B model's weights twice once packing finished.
        release_freed_memory()
        count += 1
    return count
