"""duet's own dense CPU linear with one reduction order per output element
(engine/kernels/dense_linear_cpu.cpp): fp32 or bf16. A layer on it holds its weight as the
kernel's panels (packed once here, `pack_dense`) instead of the plain [N, K] matrix, so memory
does not grow, except for a tied LM head (the embedding keeps the plain table).

Three uses:
- bf16 on a CPU without native bf16 (AVX-512 or AVX2 without AVX512-BF16 or AMX): torch's bf16
  `F.linear` goes to oneDNN's emulation there, which is neither batch-invariant (it splits the
  K reduction by the row and thread counts, so no padding helps) nor fast past one row, so
  every dense product takes the kernel (`use_dense_kernel`, at load).
- Deterministic mode, any dtype: a weight shape that the vendor GEMM does not compute
  row-invariantly at any padding `row_invariant.check_model` tries (MKL's fp32 down_proj on an
  Intel Xeon, K = 1536, at 2 threads) takes the kernel instead of being reported.
- fp32, in both modes: every dense product whose outputs fill the kernel's panels
  (`use_dense_kernel_fp32`; `DUET_PACK_FP32=1` keeps oneDNN's packed layers instead). Measured with torch 2.13 on a 2-core Intel Xeon (AVX-512,
  no AVX512-BF16), SmolLM2's shapes, 2 threads, MKL's time (`F.linear`) over the kernel's:
  1.0-1.7 at 1 row, 1.9-7.7 at 8, 2.7-3.2 at 32, 1.3-1.5 at 64, 0.95-1.1 at 256 and 0.9-1.1 at
  2,048 (MKL's own path below 64 rows is slow). On a 2-core AMD EPYC (Zen 4, 2026-11-29; 30
  layers' distinct weights at one row, 4 at more) against oneDNN's packed fp32 layers, which
  served there before: 23.4 vs 16.5 GB/s at 1 row (MKL 11.3), 1.14x faster at 32 rows, level
  at 256, 0.94x at 2,048; the embedded model's fp32 decode went from 26.1 to 41.3 tok/s at one
  stream and 300 to 355 at batch 32, and a 1,536-token prefill took 2.50 s against 2.43.
On CPUs with native bf16, oneDNN's packed kernels stay (engine/model/packed_linear.py), but in
deterministic mode bf16 takes the kernel's column pairs: AMX's tiles, or without AMX the
AVX512-BF16 dot (`use_dense_kernel_pairs`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from duet.engine.config import cpu_has_native_bf16
from duet.engine.kernels.cpu import build_cpu_kernels, cpu_kernels_enabled

logger = logging.getLogger(__name__)

SOURCES = ("dense_linear_cpu.cpp", "grouped_linear_cpu.cpp")
DTYPES = (torch.float32, torch.bfloat16)


def load_dense_kernel() -> Any | None:
    """The compiled module, or None when CPU kernels are off (`DUET_CPU_KERNELS=0`) or cannot be
    built (then `F.linear` serves, and the engine's probe reports what that gives)."""
    # NOTE: the setting is read before the cache: a process that built the module once still
    # honours `DUET_CPU_KERNELS=0` afterwards (and one that started with it off builds later).
    if not cpu_kernels_enabled():
        return None
    return _dense_kernel()


@functools.cache
def _dense_kernel() -> Any | None:
    try:
        return build_dense_kernel()
    except Exception as e:  # any build failure: fall back to torch
        logger.warning("dense CPU linear kernel unavailable (%s); using F.linear", e)
        return None


def build_dense_kernel(defines: tuple[str, ...] = ()) -> Any:
    """Compile (or load the cached build of) the module; `defines` as `build_cpu_kernels`'s."""
    return build_cpu_kernels(defines, module="duet_dense_linear", sources=SOURCES)


def layer_weight(module: nn.Module) -> torch.Tensor | None:
    """The plain [N, K] weight of a dense layer the kernel can serve (`row_invariant.Linear`,
    `TiedLinear`: the layers with a `cpu_kernel` slot) on the CPU in fp32 or bf16, else None."""
    if not hasattr(module, "cpu_kernel") or module.cpu_kernel is not None:
        return None  # not a kernel slot, or on the kernel already (its weight is panels)
    weight = getattr(module, "weight", None)
    if weight is None:  # TiedLinear: the embedding's table, held outside its parameters
        weight = getattr(module, "weight_ref", [None])[0]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if weight.device.type != "cpu" or weight.dtype not in DTYPES or not weight.is_contiguous():
        return None
    return weight


def set_dense_kernel(layers: list[nn.Module]) -> bool:
    """Route `layers` (each with a `layer_weight`) through the kernel, their weights replaced by
    its panels (a tied head's are a copy); False (nothing set) when it cannot be built."""
    kernel = load_dense_kernel()
    if kernel is None:
        return False
    for layer in layers:
        weight = layer_weight(layer)
        assert weight is not None
        if isinstance(layer, nn.Linear):
            layer.weight = nn.Parameter(pack_owned(kernel, weight), requires_grad=False)
        else:  # a tied head: the embedding keeps its table, the head gets a copy
            layer.cpu_kernel_panels = kernel.pack_dense(weight)
        layer.cpu_kernel = kernel
        del weight
    return True


def pack_owned(kernel: Any, weight: torch.Tensor) -> torch.Tensor:
    """`weight`'s panels, packed over its own storage where it holds that storage alone
    (`pack_dense_`), so packing a model allocates nothing per layer: glibc keeps freed memory in
    the heap (engine/cpu_runtime.py), where a new buffer per layer beside its freed weight
    fragmented it (a 1B-parameter bf16 model kept 1.13-1.31x its weights resident with every
    layer repacked, 1.08x without). A shared or partial storage: a new tensor."""
    owned = weight.storage_offset() == 0 and weight.untyped_storage().nbytes() == weight.nbytes
    return kernel.pack_dense_(weight.detach()) if owned else kernel.pack_dense(weight)


def use_dense_kernel(model: nn.Module) -> int:
    """bf16 on a CPU without native bf16: every dense product under `model` on the kernel.
    Returns how many layers that is (0 elsewhere, or when it cannot build)."""
    if cpu_has_native_bf16():
        return 0
    layers = _layers_of(model, torch.bfloat16)
    if not layers or not set_dense_kernel(layers):
        return 0
    logger.info("%d bf16 linear layers on duet's CPU kernel (no native bf16 here)", len(layers))
    return len(layers)


def use_dense_kernel_pairs(model: nn.Module) -> int:
    """Deterministic mode, bf16 on a CPU with AMX or (without AMX) AVX512-BF16: every bf16
    dense product under `model` whose input size the kernel packs as column pairs (a multiple
    of 32 for AMX's tiles, even for the dot) on them, batch-invariant by construction.
    AMX: on a 2-core AMX Xeon (2026-11-27) oneDNN's packed bf16 probed variant at every padding
    for SmolLM2's o, gate|up and down shapes, and the tiles took 0.25-0.45x its time at 1-17
    rows, 0.5-0.8x at 33-64 (0.8-1.2x at 256, 1.0-1.7x at 2,048). The AVX512-BF16 dot
    (engine/kernels/dense_dot.h): docs/determinism.md has its times against oneDNN's packed
    bf16 on a Zen 4. Returns how many layers (0 on other CPUs or without the kernel)."""
    kernel = load_dense_kernel()
    if kernel is None or not (kernel.amx() or kernel.bf16_dot()):
        return 0
    step = 32 if kernel.amx() else 2
    layers = [
        m
        for m in _layers_of(model, torch.bfloat16)
        if (w := layer_weight(m)) is not None and w.shape[1] % step == 0
    ]
    if not layers or not set_dense_kernel(layers):
        return 0
    what = "AMX" if kernel.amx() else "AVX512-BF16 dot"
    logger.info("%d bf16 linear layers on duet's %s kernel (deterministic mode)", len(layers), what)
    return len(layers)


def use_dense_kernel_fp32(model: nn.Module, whole_panels: bool = False) -> int:
    """Every fp32 dense product under `model` on the kernel (faster than MKL and oneDNN's packed
    fp32 up to a few hundred rows). `whole_panels` (the loader's): only layers whose output
    channels fill the kernel's panels, since padding would make the weights outgrow what
    `duet plan` counts (as for routers, `moe.use_dense_kernel_for_routers`). Returns how many
    layers."""
    layers = _layers_of(model, torch.float32)
    kernel = load_dense_kernel()
    if whole_panels and kernel is not None:
        layers = [m for m in layers if fills_panels(kernel, m)]
    if not layers or not set_dense_kernel(layers):
        return 0
    logger.info("%d fp32 linear layers on duet's CPU kernel", len(layers))
    return len(layers)


def fills_panels(kernel: Any, layer: nn.Module) -> bool:
    """Whether `layer`'s output channels fill the kernel's panels exactly (no padded channels,
    so its weights take no more memory on the kernel than plain)."""
    weight = layer_weight(layer)
    tile = kernel.pack_dense(torch.zeros(1, 16)).shape[-1]  # output channels per panel
    return weight is not None and weight.shape[0] % tile == 0


def _layers_of(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """The layers under `model` the kernel can serve whose weight is `dtype`."""
    return [m for m in model.modules() if (w := layer_weight(m)) is not None and w.dtype == dtype]
