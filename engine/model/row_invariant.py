"""Batch-invariant linear layers on the CPU: a row's result must not depend on how many rows
share the matrix product (deterministic inference, docs/determinism.md).

oneDNN and MKL pick their GEMM kernel by the number of rows M. Measured on a 2-core AMD EPYC
(AVX512-BF16; torch 2.13): a row computed alone (M = 1, a GEMV-like kernel) differs in the
last bits from the same row inside a batch for most of SmolLM2's and Llama-8B's projection
shapes, in bf16 (oneDNN, packed or not) and in fp32 (MKL: every row; packed oneDNN: K = 1536);
MKL fp32 also gives a row at M = 9 its own tail kernel. From 16 rows up every M tried
(16 to 2048) gave every row bit-identical results, at 1 and 2 threads. So every product runs
on at least `MIN_ROWS` rows: fewer are padded with zero rows, whose results are dropped.

That is an observation about these libraries, not their contract, so `probe` checks it for
each of a model's weight shapes when the engine is built (`LinearInvariance`); a CPU or a
library where it fails is reported (the engine then says it is not deterministic) instead of
assumed. CUDA is left alone: cuBLAS is not batch-invariant at any padding (docs/determinism.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MIN_ROWS = 16
"""Fewest rows a CPU matrix product runs on, unless `check_model` found fewer enough."""

MIN_ROWS_CANDIDATES = (1, 8, 16)
"""What `check_model` tries per weight shape, fewest rows first: padding costs single-stream
time (8 rows: about 11% of a bf16 SmolLM2 decode step on one AVX512-BF16 EPYC core), so a
shape that is invariant unpadded stays unpadded. Measured there: oneDNN's packed bf16 kernels
are invariant unpadded for SmolLM2's q|k|v, o and gate|up shapes and need 8 rows for down_proj
(K = 1536); MKL's fp32 GEMM gives 9 rows their own kernel, so it needs 16."""

PROBE_ROWS = (1, 2, 3, 9, 15, 16, 17, 40, 64, 130, 257, 600)
"""Batch sizes `probe` runs (larger prefill chunks are assumed to take the largest's path)."""

PROBE_ALONE = (0, 1, 2, 8, 14, 15, 16, 39, 63, 129, 256, 599)
"""Rows `probe` also computes alone, to compare with the same rows in every batch above."""


def pad_rows(x: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor:
    """`x` ([M, K]) with zero rows appended up to `min_rows` on the CPU; as is otherwise."""
    rows = x.shape[0]
    if rows >= min_rows or x.device.type != "cpu":
        return x
    return torch.cat([x, x.new_zeros(min_rows - rows, x.shape[1])])


def linear_rows(
    x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], min_rows: int = MIN_ROWS
) -> torch.Tensor:
    """`fn` (a row-wise product of a [M, K] matrix) applied to `x` ([..., K]) on at least
    `min_rows` rows."""
    if x.dim() == 2 and x.shape[0] >= min_rows and x.stride(-1) == 1:
        return fn(x)  # the common case (every decode and prefill step): nothing to reshape
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = fn(pad_rows(rows, min_rows))[: rows.shape[0]]
    return out.view(*x.shape[:-1], out.shape[-1])


def product(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    invariant_gemm: bool,
    cpu_kernel: Any = None,
    out_features: int = 0,
) -> torch.Tensor:
    """F.linear; on CUDA with `invariant_gemm` the batch-invariant Triton product
    (engine/kernels/triton_matmul.py; cuBLAS is not batch-invariant); with `cpu_kernel`
    (engine/model/dense_cpu_linear.py) duet's own, one reduction order per element, and then
    `weight` is the kernel's panels of the [out_features, K] weight."""
    if cpu_kernel is not None:
        return cpu_kernel.dense_linear_packed(rows, weight, out_features, bias)
    if invariant_gemm and rows.device.type == "cuda":
        from duet.engine.kernels.triton_matmul import invariant_linear

        return invariant_linear(rows, weight, bias)
    return F.linear(rows, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` whose result per row does not depend on the batch on the CPU (padding), and
    on CUDA with `invariant_gemm` set (`use_invariant_gemm`)."""

    min_rows: int = MIN_ROWS
    invariant_gemm: bool = False
    cpu_kernel: Any = None
    """duet's dense CPU kernel module, where `dense_cpu_linear` set it (None: F.linear); then
    `weight` holds the kernel's panels of the weight instead of the plain [N, K] matrix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.cpu_kernel
        if kernel is not None and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] >= self.min_rows:
            # duet's kernel on rows as they are (every CPU step), without linear_rows' and
            # _product's Python calls (QuantizedLinear.forward does the same)
            params: dict[str, Any] = self._parameters
            return product(x, params["weight"], params["bias"], False, kernel, self.out_features)
        return linear_rows(x, self._product, self.min_rows)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        # the parameters from their dict: `self.weight` is a Python call (nn.Module.__getattr__)
        params: dict[str, Any] = self._parameters
        return product(
            rows, params["weight"], params["bias"], self.invariant_gemm, self.cpu_kernel,
            self.out_features,
        )  # fmt: skip


class TiedLinear(nn.Module):
    """The LM head of a model whose head is its embedding table (not a parameter of its own:
    the table stays the embedding's, out of the state dict)."""

    min_rows: int = MIN_ROWS
    invariant_gemm: bool = False
    cpu_kernel: Any = None
    cpu_kernel_panels: torch.Tensor | None = None
    """With `cpu_kernel`: the kernel's panels of the table, a copy (the embedding keeps it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight_ref = [weight]  # a list: not registered as a parameter or buffer
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self._product, self.min_rows)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.weight_ref[0] if self.cpu_kernel is None else self.cpu_kernel_panels
        assert weight is not None
        return product(rows, weight, None, self.invariant_gemm, self.cpu_kernel, self.out_features)


def use_invariant_gemm(model: nn.Module) -> int:
    """Route every dense projection and LM head of `model` through the batch-invariant Triton
    product on CUDA (quantized layers are not); returns how many layers that is."""
    layers = [m for m in model.modules() if isinstance(m, Linear | TiedLinear)]
    for layer in layers:
        layer.invariant_gemm = True
    return len(layers)


def probe(layer: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
          seed: int = 0) -> bool:  # fmt: skip
    """Whether `layer` gives each row the same bits alone as inside every batch of
    `PROBE_ROWS`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(PROBE_ROWS), in_features, generator=gen).to(dtype)
    alone = {i: layer(x[i : i + 1])[0] for i in PROBE_ALONE}
    for m in PROBE_ROWS:
        out = layer(x[:m])
        if not all(torch.equal(out[i], row) for i, row in alone.items() if i < m):
            return False
    return True


@dataclass
class LinearInvariance:
    """What `check_model` found: each distinct weight shape's rows, and the ones that failed."""

    min_rows: dict[tuple[int, int], int] = field(default_factory=dict)
    failed: list[tuple[int, int]] = field(default_factory=list)
    num_on_kernel: int = 0
    """Layers moved to duet's dense kernel because their vendor product probed variant."""

    @property
    def ok(self) -> bool:
        return not self.failed


def check_model(model: nn.Module, dtype: torch.dtype) -> LinearInvariance:
    """For each distinct (class, out, in) shape of matrix product under `model` (CPU only),
    the fewest rows of `MIN_ROWS_CANDIDATES` at which one such layer probes batch-invariant;
    every layer of that shape is set to it. A shape invariant at none moves to duet's dense
    kernel (row-invariant by construction), or, failing that, keeps `MIN_ROWS` and is reported.

    In fp32 a shape that MKL does not compute row-invariantly unpadded goes to the kernel
    instead of being padded. Measured on a 2-core Intel Xeon (AVX-512, no AVX512-BF16), per
    call, MKL padded to 16 rows against the kernel: SmolLM2's gate|up 2.26 vs 0.84 ms at 1-16
    rows, down_proj 1.02 vs 0.30 ms, the LM head 34.1 vs 13.3 ms at 16 rows (7.5 vs 7.3 at 1);
    unpadded MKL is slower than the kernel up to a few hundred rows and at most 1.25x faster
    at 2,048 (its outer-product form, engine/kernels/dense_linear_cpu.cpp). bf16 keeps the vendor's padding: oneDNN's packed bf16 on native-bf16 CPUs
    (AMX) is far faster than the kernel's fp32 FMAs past a few rows."""
    result = LinearInvariance()
    groups: dict[tuple[str, int, int], list[nn.Module]] = {}
    for module in model.modules():
        shape = _shape(module)
        if shape is not None:
            groups.setdefault((type(module).__name__, *shape), []).append(module)
    for (_, out_features, in_features), layers in groups.items():
        # fp32: unpadded, else duet's kernel, before any padded vendor GEMM (see above).
        kernel_first = dtype == torch.float32
        first = MIN_ROWS_CANDIDATES[:1] if kernel_first else MIN_ROWS_CANDIDATES
        chosen = _fewest_rows(layers[0], in_features, dtype, first)
        if chosen is None and _use_kernel(layers, in_features, dtype):
            chosen = 1
            result.num_on_kernel += len(layers)
        if chosen is None and kernel_first:  # no kernel: padding it is
            chosen = _fewest_rows(layers[0], in_features, dtype, MIN_ROWS_CANDIDATES[1:])
        if chosen is None:
            result.failed.append((out_features, in_features))
        for layer in layers:
            setattr(layer, "min_rows", MIN_ROWS if chosen is None else chosen)  # noqa: B010
        result.min_rows[(out_features, in_features)] = MIN_ROWS if chosen is None else chosen
    if result.failed:
        logger.warning(
            "linear layers of shapes %s are not batch-invariant on this CPU at %s rows: "
            "outputs may depend on the batch (not deterministic)",
            result.failed, MIN_ROWS_CANDIDATES,
        )  # fmt: skip
    return result


def _fewest_rows(
    layer: nn.Module, in_features: int, dtype: torch.dtype, candidates: tuple[int, ...]
) -> int | None:
    """The first of `candidates` at which `layer`, padded to that many rows, probes invariant."""
    for rows in candidates:
        setattr(layer, "min_rows", rows)  # noqa: B010 (nn.Module's attribute typing)
        if probe(layer, in_features, dtype):
            return rows
    return None


def _use_kernel(layers: list[nn.Module], in_features: int, dtype: torch.dtype) -> bool:
    """Move `layers` (one shape whose vendor product probed variant at every padding) to duet's
    dense kernel, which is row-invariant by construction; probed again. False: not a plain
    dense layer or no kernel (left as they were), or, unexpectedly, still variant."""
    from duet.engine.model.dense_cpu_linear import layer_weight, set_dense_kernel

    # layer_weight is None for a layer already on the kernel (its weight is panels).
    if any(layer_weight(m) is None for m in layers) or not set_dense_kernel(layers):
        return False
    setattr(layers[0], "min_rows", 1)  # noqa: B010
    logger.info(
        "%d linear layers of %d inputs on duet's kernel: the vendor GEMM is not "
        "batch-invariant for them here", len(layers), in_features,
    )  # fmt: skip
    # The layers now hold the kernel's panels only: they stay on it even if (unexpectedly)
    # this probe fails, which then reports them.
    return probe(layers[0], in_features, dtype)


def set_min_rows(model: nn.Module, rows: int) -> None:
    """Every matrix product under `model` on at least `rows` rows (1: no padding)."""
    for module in model.modules():
        if _shape(module) is not None:
            setattr(module, "min_rows", rows)  # noqa: B010


def _shape(module: nn.Module) -> tuple[int, int] | None:
    if not hasattr(module, "min_rows"):
        return None
    out_features = getattr(module, "out_features", None)
    in_features = getattr(module, "in_features", None)
    if isinstance(out_features, int) and isinstance(in_features, int):
        return out_features, in_features
    return None


def elementwise(op: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`op(x)` for a unary elementwise torch op such as torch.exp or torch.sigmoid, each
    element's bits independent of where it sits in `x`.

    NOTE: torch's CPU kernels run a contiguous tensor through vector code (SLEEF) and its last
    few elements through scalar code (std::exp), which differ in the last bit, so an element's
    bits depended on the tensor's size (`moe.sigmoid_rows`). On a strided copy every element
    takes the scalar code. Elsewhere `op(x)` as is."""
    if x.device.type != "cpu":
        return op(x)
    strided = x.new_empty(*x.shape, 2)[..., 0]
    strided.copy_(x)
    out = x.new_empty(*x.shape, 2)[..., 0]
    op(strided, out=out)
    return out
