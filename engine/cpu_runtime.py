"""Process-wide CPU settings that decide whether inference runs at memory bandwidth.

NOTE: both are global to the process, which is why they are applied once, at engine start,
and only when the engine runs on the CPU.
- Denormals: softmax outputs and activations underflow into denormal floats, which x86
  multiplies ~100x slower; flushing them to zero changes nothing visible (they are < 1e-38).
- glibc malloc serves large blocks with fresh mmaps, so every step's temporary tensors
  (KV gathers, activations) page-fault again; keeping freed memory in the heap makes the
  second step reuse warm pages (5-10x faster copies measured on a 2-core EPYC VM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_configured = False


def configure_cpu_runtime() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    torch.set_flush_denormal(True)
    from engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is not None:  # the intra-op worker threads too (torch's call covers this one)
        kernels.flush_denormals_on_all_threads()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 40)
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        logger.debug("mallopt unavailable; large allocations will page-fault each step")
