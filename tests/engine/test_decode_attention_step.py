"""`decode_attention_step`: a decode-only step's rotary embedding, KV write and paged decode
attention in one C++ call per layer gives bit for bit what the three separate calls give (the
output and the cache), and the model takes it for steps of decodes only: the engine's tokens
and logprobs are the same with and without it, fp32 and bf16, alone and in a batch."""

from __future__ import annotations

import pytest
import torch

import duet.engine.model.llama as llama
from duet.engine import LLM, SamplingParams
from duet.engine.attention import decode_only_kernels

# (query heads, KV heads, head size, block size): SmolLM2's; Llama-3-8B's; multi-head
SHAPES = [(9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 32, 4)]
LENGTHS = [1, 17, 300, 2500]  # the last two span several attention partitions


def step_inputs(shape, dtype, seed=0):
    heads, kv_heads, dim, block = shape
    g = torch.Generator().manual_seed(seed)
    tokens = len(LENGTHS)
    blocks = [-(-n // block) for n in LENGTHS]
    num_blocks = sum(blocks) + 2
    kv_cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    tables = torch.zeros(tokens, max(blocks), dtype=torch.long)
    perm, used = torch.randperm(num_blocks, generator=g), 0
    for row, n in enumerate(blocks):
        tables[row, :n] = perm[used : used + n]
        used += n
    positions = torch.tensor([n - 1 for n in LENGTHS])  # each token the last of its sequence
    slots = torch.tensor([int(tables[i, p // block]) * block + p % block for i, p in
                          enumerate(positions.tolist())])  # fmt: skip
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    freqs = torch.outer(torch.arange(4096.0), 1e4 ** (-torch.arange(0, dim, 2) / dim))
    return qkv, positions, freqs.cos(), freqs.sin(), kv_cache, slots, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-Hkv{}-D{}-BS{}".format(*s))
def test_one_call_is_the_three_calls(kernels, threads, shape, dtype):
    heads, kv_heads, dim, _ = shape
    qkv, positions, cos, sin, kv_cache, slots, tables = step_inputs(shape, dtype)
    lens, rows = torch.tensor(LENGTHS), torch.arange(len(LENGTHS))
    # the three calls, as Attention.forward made them
    qkv3, cache3 = qkv.clone(), kv_cache.clone()
    q, k, v = qkv3.split_with_sizes([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(-1, heads, dim)
    k, v = k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    kernels.rotary_embedding(positions, q, k, cos, sin)
    kernels.write_kv(cache3, k, v, slots)
    want = torch.empty_like(q)
    kernels.paged_decode_attention(want, q, cache3[0], cache3[1], tables, lens, rows, 0.125)
    got = kernels.decode_attention_step(
        qkv, positions, cos, sin, kv_cache, slots, tables, lens, rows, heads, kv_heads, 0.125
    )
    assert got.shape == (len(LENGTHS), heads * dim) and got.dtype == dtype
    assert torch.equal(got.view(-1, heads, dim), want)
    assert torch.equal(kv_cache, cache3)  # the step's K (rotated) and V at their slots


def test_a_width_that_is_not_the_heads_is_refused(kernels):
    qkv, positions, cos, sin, kv_cache, slots, tables = step_inputs((9, 3, 64, 16), torch.float32)
    lens, rows = torch.tensor(LENGTHS), torch.arange(len(LENGTHS))
    with pytest.raises(RuntimeError, match=r"qkv's width must be \(8 \+ 2 x 3\) x 64"):
        kernels.decode_attention_step(
            qkv, positions, cos, sin, kv_cache, slots, tables, lens, rows, 8, 3, 0.125
        )


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], object]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_takes_it_for_decodes_and_changes_nothing(smollm2_shaped, monkeypatch, dtype):
    llm = LLM(smollm2_shaped, dtype=dtype, load_progress=False, num_kv_blocks=256)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 40, 90, 17)]
    calls: list[int] = []

    class Counting:  # the kernels, counting the fused calls
        def __init__(self, module):
            self.module = module

        def decode_attention_step(self, qkv, *args):
            calls.append(qkv.shape[0])
            return self.module.decode_attention_step(qkv, *args)

    def counting(meta, device):
        module = decode_only_kernels(meta, device)
        return None if module is None else Counting(module)

    monkeypatch.setattr(llama, "decode_only_kernels", counting)
    fused = [generate(llm, [p]) for p in prompts], generate(llm, prompts)
    # 2 layers x 11 decode steps per generate; the batch's steps hold every running request
    assert len(calls) == 2 * 11 * (len(prompts) + 1) and set(calls) == {1, 4}
    monkeypatch.setattr(llama, "decode_only_kernels", lambda meta, device: None)
    separate = [generate(llm, [p]) for p in prompts], generate(llm, prompts)
    assert fused == separate
    assert [out for alone in fused[0] for out in alone] == fused[1]  # batch-invariant, as before
