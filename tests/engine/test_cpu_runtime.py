"""engine/cpu_runtime.py: the process-wide glibc settings CPU engines run with, and the KV
pool's zero pages."""

from __future__ import annotations

import resource
import subprocess
import sys

import torch

from duet.engine.cpu_runtime import zeroed_host_tensor

# NOTE: in a process of its own: under xdist the worker also runs threads of earlier tests
# (engines, servers) that allocate from the same heap, and one that takes the freed block
# between the free and the reallocation makes the reallocation fault in fresh pages (seen
# once in a loaded run).
REUSE = """
import resource, torch
from duet.engine.cpu_runtime import keep_freed_memory
assert keep_freed_memory()
numel = (32 << 20) // 4
warm = torch.empty(numel)
warm.fill_(1.0)
del warm
before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
# 1 MiB less than was freed: in about one process of four something allocates a few bytes
# between the free and this call and takes them from the front of the freed block, and a
# request for all 32 MB then no longer fits there (measured: 8,192 faults then, 0 with this)
again = torch.empty(numel - (1 << 18))
again.fill_(2.0)
assert again[-1].item() == 2.0
print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
"""


def test_a_freed_large_tensor_is_reused_without_page_faults() -> None:
    # A 2048-token prefill of SmolLM2 frees and reallocates a 24 MB MLP activation per layer;
    # with glibc's defaults (or a trim threshold of 0) every one of them faults its pages in
    # again: 8192 faults for these 32 MB.
    run = subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    faults = int(run.stdout.split()[-1])
    assert faults < 256, f"{faults} page faults reallocating 32 MB (8192 if nothing is kept)"


def test_the_kv_pool_is_zeros_that_take_no_memory_until_written() -> None:
    # 256 MiB: with torch.zeros every page would be written (and resident) at once.
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    kv = zeroed_host_tensor((2, 4096, 16, 64, 64), torch.bfloat16)
    assert kv.shape == (2, 4096, 16, 64, 64) and kv.dtype == torch.bfloat16
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 64
    kv[1, 4095].fill_(3.0)  # the last block: written where the caches write
    assert kv[1, 4095].eq(3.0).all() and kv[0].count_nonzero() == 0
    assert kv[1, :4095].count_nonzero() == 0
