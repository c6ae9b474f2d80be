"""`python -m duet.engine.kernels.prebuild`: compile the C++ CPU kernels the engine loads (or
find them built), before anything needs them. `make install` runs it.

The kernels are compiled on first use (engine/kernels/cpu.py), which on a new machine puts
several minutes of g++ into the first engine's start-up: the first `make test` then builds
them inside the tests, beside three test workers and Ray's actors, where a cluster's start
can run out its time (seen on a fresh VM: the Ray cluster tests' 600 s). Built here once, every
later process only loads them. A kernel that cannot be built is reported, not fatal: the
engine falls back to torch's paths as it would anyway. Exits 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def kernels() -> dict[str, Callable[[], Any]]:
    """Each kernel module the engine loads by default, by name, with its loader."""
    from duet.engine.kernels.cpu import load_cpu_kernels
    from duet.engine.model.dense_cpu_linear import load_dense_kernel
    from duet.engine.quant.cpu_linear import load_quant_kernels
    from duet.engine.shm_collectives import _kernels as load_shm_collectives

    return {
        "duet_cpu_kernels": load_cpu_kernels,
        "duet_dense_linear": load_dense_kernel,
        "duet_quant_linear": load_quant_kernels,
        "duet_shm_collectives": load_shm_collectives,
    }


def prebuild() -> dict[str, bool]:
    """Build (or load) every kernel module; name -> whether it is available."""
    available = {}
    for name, load in kernels().items():
        start = time.perf_counter()
        module = load()
        available[name] = module is not None
        state = "ready" if module is not None else "unavailable (torch's paths serve)"
        print(f"{name}: {state} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return available


if __name__ == "__main__":
    prebuild()
