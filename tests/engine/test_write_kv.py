"""The CPU kernel that stores a step's K/V in the paged cache (`write_kv`, one memcpy per
token row) writes what `index_copy_` writes, from the strided views of q|k|v the model hands
it, and refuses a slot outside the cache."""

from __future__ import annotations

import pytest
import torch

from duet.engine.attention import write_kv_cache
from duet.engine.kernels.cpu import load_cpu_kernels


def _reference(kv_cache, key, value, slots):
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hkv", [1, 3])
def test_write_kv_is_index_copy(dtype, tokens, hkv):
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here"
    gen = torch.Generator().manual_seed(tokens * 10 + hkv)
    num_blocks, block_size, d, heads = 40, 16, 64, 9
    qkv = torch.randn(tokens, (heads + 2 * hkv) * d, generator=gen).to(dtype)
    _, k, v = qkv.split([heads * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(tokens, hkv, d), v.view(tokens, hkv, d)  # strided, as in the model
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    start = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    got, want = start.clone(), start.clone()
    kernels.write_kv(got, k, v, slots)
    _reference(want, k, v, slots)
    assert torch.equal(got, want)
    # write_kv_cache takes the kernel on the CPU, and keeps index_copy_ for a dtype change
    again = start.clone()
    write_kv_cache(again, k, v, slots)
    assert torch.equal(again, want)
    if dtype == torch.float32:
        half = start.to(torch.bfloat16)
        want_half = half.clone()
        write_kv_cache(half, k, v, slots)
        _reference(want_half, k, v, slots)
        assert torch.equal(half, want_half)


def test_write_kv_packs_a_transposed_key_and_takes_int32_slots():
    kernels = load_cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 5, 3, generator=gen).permute(2, 0, 1)  # [3 tokens, 2 heads, 5]
    v = torch.randn(3, 2, 5, generator=gen)
    slots = torch.tensor([4, 0, 9], dtype=torch.int32)
    got = torch.zeros(2, 4, 4, 2, 5)
    want = got.clone()
    kernels.write_kv(got, k, v, slots)
    _reference(want, k, v, slots.long())
    assert torch.equal(got, want)


def test_write_kv_refuses_a_slot_outside_the_cache():
    kernels = load_cpu_kernels()
    assert kernels is not None
    cache = torch.zeros(2, 2, 4, 1, 8)
    k = v = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 8 is outside \[0, 8\)"):
        kernels.write_kv(cache, k, v, torch.tensor([0, 8]))
    assert not cache.any()  # checked before anything is written
