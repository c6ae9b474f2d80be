"""Shared by the Triton kernel tests: random paged-attention cases run through the Triton and the
torch paths, and the specialisation key Triton would compile a launch under.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; with CUDA, compiled.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from duet.engine.attention import GatherWorkspace, paged_attention, store_kv, write_kv_cache
from duet.engine.attention_metadata import AttentionMetadata

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    """Without CUDA the kernels run in Triton's interpreter: tests/conftest.py sets
    TRITON_INTERPRET=1 before anything imports triton (it fixes the mode at the first import of
    triton.language, which transformers may do early); this keeps it set while these tests run
    and imports the kernel modules under it."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language  # noqa: F401

    import duet.engine.kernels.triton_cache
    import duet.engine.kernels.triton_decode
    import duet.engine.kernels.triton_prefill  # noqa: F401


def make_case(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random cache with scattered block tables, and this step's q/k/v (k/v not yet written)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = dict(generator=g, device=DEVICE)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 7
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, **rand).to(dtype)
    perm = torch.randperm(num_blocks, **rand).tolist()
    block_ids, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        block_ids.append(perm[used : used + n])
        used += n
    total = sum(query_lens)
    qkv = [torch.randn(total, h, head_dim, **rand).to(dtype) for h in (heads, kv_heads, kv_heads)]
    return [cache, *qkv], block_ids


def run_both(
    query_lens,
    seq_lens,
    heads,
    kv_heads,
    head_dim,
    block_size,
    dtype,
    num_splits=None,
    ref_fp32=False,
):
    """(triton output, reference output, triton cache, reference cache). `ref_fp32`: the
    reference computes in fp32 from the same (e.g. bf16) values."""
    (cache, q, k, v), block_ids = make_case(
        query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype
    )
    tri_cache, ref_cache = cache.clone(), cache.clone()
    tri_q, tri_k, tri_v = q, k, v
    if ref_fp32:
        ref_cache, q, k, v = ref_cache.float(), q.float(), k.float(), v.float()
    ref_meta = AttentionMetadata.build(query_lens, seq_lens, block_ids, block_size, DEVICE)
    tri_meta = AttentionMetadata.build(
        query_lens, seq_lens, block_ids, block_size, DEVICE, triton_num_kv_heads=kv_heads
    )
    assert tri_meta.kernel_batch is not None
    if num_splits is not None:
        tri_meta.kernel_batch.num_splits = num_splits
    write_kv_cache(ref_cache, k, v, ref_meta.slot_mapping)
    store_kv(tri_cache, tri_k, tri_v, tri_meta)
    scale = head_dim**-0.5
    ref = paged_attention(q, k, v, ref_cache, ref_meta, scale, GatherWorkspace())
    out = paged_attention(tri_q, tri_k, tri_v, tri_cache, tri_meta, scale, GatherWorkspace())
    return out, ref, tri_cache, ref_cache


def specialization_key(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> str:
    """What Triton's JIT keys its compiled-kernel cache on for this launch (argument types,
    the values and alignments it specialises on, constexprs, options), computed with Triton's
    own binder, so it works for interpreted kernels too."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    options = getattr(kernel, "kwargs", None) or {}  # an InterpretedFunction keeps them here
    dns = options.get("do_not_specialize", getattr(kernel, "do_not_specialize", None)) or []
    dnsa_default = getattr(kernel, "do_not_specialize_on_alignment", None)
    dnsa = options.get("do_not_specialize_on_alignment", dnsa_default) or []
    sig = inspect.signature(kernel.fn)
    params = [
        KernelParam(i, p, p.name in dns, p.name in dnsa)
        for i, p in enumerate(sig.parameters.values())
    ]
    binder = create_function_from_signature(sig, params, BaseBackend)
    _, specialization, launch_options = binder(*args, **kwargs)
    return f"{specialization} {sorted(launch_options.items())}"


@contextmanager
def recorded_specializations(monkeypatch, *kernels: Any) -> Iterator[dict[str, set[str]]]:
    """Within the block, every launch of `kernels` adds its specialisation key to
    result[kernel name] (and still runs)."""
    keys: dict[str, set[str]] = {k.fn.__name__: set() for k in kernels}
    for kernel in kernels:
        run = kernel.run

        def recording(*args, grid, warmup, _run=run, _kernel=kernel, **kwargs):
            keys[_kernel.fn.__name__].add(specialization_key(_kernel, args, kwargs))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", recording)
    yield keys
