"""Whether Triton can run here, and how: compiled on CUDA, or Triton's interpreter on CPU.

Triton picks the interpreter when `triton.language` is first imported (its library functions
such as `tl.max` are decorated then, as are duet's kernels when their modules load) and reads
`TRITON_INTERPRET` again while interpreting, so the variable must be set from before the first
import of triton until the last interpreted launch: CPU tests set it, a GPU process never does.
One process cannot run both modes.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package imports (a dependency on Linux x86_64 only)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install is the same as none: the torch path still works
        return False
    return True


def triton_mode() -> str:
    """How this process runs duet's Triton kernels: "compiled", "interpreted", or "mixed" when
    `triton.language` and duet's kernel modules were imported under different values of
    TRITON_INTERPRET (unusable). Imports them, which fixes the mode for the process."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from duet.engine.kernels import triton_cache, triton_decode, triton_prefill

    kernels = (
        tl.cdiv,
        triton_cache._write_kv_kernel,
        triton_decode._decode_kernel,
        triton_prefill._prefill_kernel,
    )
    interpreted = {isinstance(k, InterpretedFunction) for k in kernels}
    if len(interpreted) > 1:
        return "mixed"
    return "interpreted" if interpreted.pop() else "compiled"


def triton_unusable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process, or None when they can."""
    if not triton_available():
        return "the triton package is not installed (it is a dependency on Linux x86_64)"
    mode = triton_mode()
    if mode == "mixed":
        return (
            "triton.language and duet's kernels were imported under different TRITON_INTERPRET "
            "values; set it (or not) before the first import of triton"
        )
    if device.type == "cuda" and mode == "interpreted":
        return "Triton was imported under TRITON_INTERPRET=1: kernels would run on the CPU"
    if device.type != "cuda" and (
        mode == "compiled" or os.environ.get("TRITON_INTERPRET", "0") != "1"
    ):
        # The interpreter also reads the variable while it runs, so it must still be set.
        return (
            "on CPU the Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before the process imports triton (meant for tests; use auto or torch)"
        )
    return None
