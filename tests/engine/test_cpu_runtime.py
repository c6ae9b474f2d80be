"""engine/cpu_runtime.py: the process-wide glibc settings CPU engines run with."""

from __future__ import annotations

import resource

import torch

from duet.engine.cpu_runtime import keep_freed_memory


def _minor_faults() -> int:
    # NOTE: this thread's faults only: under xdist the process also runs threads of earlier
    # tests (engines, servers), whose faults counted here once made 1,493 of a run.
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_freed_large_tensor_is_reused_without_page_faults() -> None:
    # A 2048-token prefill of SmolLM2 frees and reallocates a 24 MB MLP activation per layer;
    # with glibc's defaults (or a trim threshold of 0) every one of them faults its pages in
    # again: 8192 faults for these 32 MB.
    assert keep_freed_memory()
    numel = (32 << 20) // 4
    warm = torch.empty(numel)
    warm.fill_(1.0)
    del warm
    before = _minor_faults()
    again = torch.empty(numel)
    again.fill_(2.0)
    faults = _minor_faults() - before
    assert again[-1].item() == 2.0
    assert faults < 256, f"{faults} page faults reallocating 32 MB (8192 if nothing is kept)"
