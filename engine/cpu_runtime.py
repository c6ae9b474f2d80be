"""Process-wide CPU settings that decide whether inference runs at memory bandwidth.

NOTE: both are global to the process, which is why they are applied once, at engine start,
and only when the engine runs on the CPU.
- Denormals: softmax outputs and activations underflow into denormal floats, which x86
  multiplies ~100x slower; flushing them to zero changes nothing visible (they are < 1e-38).
- glibc malloc serves large blocks with fresh mmaps and trims the heap's free top, so every
  step's temporary tensors (KV gathers, activations) page-fault again; keeping freed memory in
  the heap makes the second step reuse warm pages (5-10x faster copies measured on a 2-core
  EPYC VM; a 2048-token prefill step of SmolLM2 fp32 took ~183k page faults, 24 MB per layer,
  before the trim threshold below was set right).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt takes a C int: the largest threshold it can hold. (ctypes truncates a larger Python
# int to its low 32 bits without a word; 1 << 40 became 0, which trims the heap on every free.)
_NEVER_TRIM = 2**31 - 1
_configured = False


def configure_cpu_runtime() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    torch.set_flush_denormal(True)
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is not None:  # the intra-op worker threads too (torch's call covers this one)
        kernels.flush_denormals_on_all_threads()
    keep_freed_memory()


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the heap (no mmap-served blocks, no trimming), so a
    step's temporaries reuse pages that are already mapped. Returns False where there is no
    glibc `mallopt` (e.g. musl)."""
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    except (OSError, AttributeError):  # not glibc: nothing to tune
        ok = False
    if not ok:
        logger.debug("mallopt unavailable; large allocations will page-fault each step")
    return ok


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system now (glibc `malloc_trim(0)`, which also
    releases whole free pages inside the heap, not only at its top). For load time, when a
    weight freed as its replacement is built would otherwise stay resident beside it under
    `keep_freed_memory`. A no-op without glibc."""
    libc = _libc()
    if libc is None:
        return
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (`find_library` runs `ldconfig` in a subprocess: once per process)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros in a private anonymous mapping of its own: the kernel gives each page
    as zeros when it is first touched, so a KV pool costs neither time nor resident memory
    until its blocks are written (`torch.zeros` wrote every byte up front: about 0.4 s per
    GiB on a 2-core VM, for each engine built), and it is never served from the heap that
    `keep_freed_memory` keeps. The mapping lives as long as the tensor."""
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
