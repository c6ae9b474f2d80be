"""CPU kernels in C++, compiled on first use with torch's cpp_extension (needs g++ and ninja).

When the build is impossible (no compiler) the engine keeps the torch reference path, which
computes the same thing; `DUET_CPU_KERNELS=0` forces that path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_decode_cpu.cpp")


@functools.cache
def load_cpu_kernels() -> Any | None:
    """The compiled module, or None when kernels are off or cannot be built."""
    if os.environ.get("DUET_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import is_ninja_available, load
    except ImportError:
        return None
    if not is_ninja_available():
        # ninja is a dependency, installed beside this interpreter, which may not be on PATH.
        os.environ["PATH"] = (
            os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        )
    with open(_SOURCE, "rb") as f:
        source_hash = hashlib.sha1(f.read()).hexdigest()[:10]
    # -march=native code must never run on another CPU: key the build on the CPU's flags too.
    name = f"duet_cpu_kernels_{source_hash}_{_cpu_fingerprint()}"
    try:
        return load(
            name=name,
            sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # any build failure: fall back to the torch reference path
        logger.warning("CPU kernels unavailable (%s); using the torch reference attention", e)
        return None


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
) -> None:
    """Write attention of query rows `token_indices` (one per sequence) into the same rows
    of `out`. query/out: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    kernels.paged_decode_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, token_indices, scale
    )
