"""duet's Triton kernels (engine/kernels/triton_*.py) against the torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors at tiny shapes; with CUDA the
same cases run compiled, and `TestOnCuda` adds real shapes in bf16. A subprocess compiles every
kernel for sm_90 (no GPU needed) to catch what the interpreter lets through.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import (
    AttentionMetadata,
    GatherWorkspace,
    paged_attention,
    store_kv,
    write_kv_cache,
)
from engine.kernels.triton_runtime import triton_unusable_reason

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    """Without CUDA the kernels run in Triton's interpreter: tests/conftest.py sets
    TRITON_INTERPRET=1 before anything imports triton (it fixes the mode at the first import of
    triton.language, which transformers may do early); this keeps it set while these tests run
    and imports the kernel modules under it."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton.language  # noqa: F401

    import engine.kernels.triton_cache
    import engine.kernels.triton_decode
    import engine.kernels.triton_prefill  # noqa: F401


FP32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def test_triton_runs_here():
    assert triton_unusable_reason(DEVICE) is None


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


def test_write_kv_cache_by_slot_skips_negative_slots():
    from engine.kernels.triton_cache import write_kv_cache as triton_write_kv_cache

    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 4, 2, 24, generator=g).to(DEVICE)
    # k/v as strided views of a fused projection, as the model produces them
    fused = torch.randn(5, 3, 2, 24, generator=g).to(DEVICE)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.tensor([3, -1, 17, 0, -1], device=DEVICE)
    expected = cache.clone()
    keep = slots >= 0
    write_kv_cache(expected, key[keep], value[keep], slots[keep])
    triton_write_kv_cache(cache, key, value, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_k_matches_reference(num_splits):
    # GQA group 2; contexts from one token to several 32-key tiles over many 8-token blocks,
    # so some splits are empty and some span block boundaries.
    seq_lens = [1, 9, 70, 200]
    out, ref, tri_cache, ref_cache = run_both(
        [1] * 4, seq_lens, 4, 2, 32, 8, torch.float32, num_splits
    )
    assert torch.equal(tri_cache, ref_cache)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_decode_row_with_empty_context_is_zero():
    # A padded CUDA-graph row carries seq_len 0: every split is empty and the merge gives 0.
    from engine.kernels.triton_decode import paged_decode_attention

    (cache, q, _, _), block_ids = make_case([1, 1], [40, 1], 4, 2, 16, 4, torch.float32)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    table = torch.zeros(2, 10, **i32)
    table[0] = torch.tensor(block_ids[0], **i32)
    out = torch.full_like(q, 7.0)
    args = (torch.tensor([0, 1, 2], **i32), torch.tensor([40, 0], **i32), table)
    paged_decode_attention(out, q, cache, *args, torch.tensor([0, 1], **i32), 0.25, 4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref_meta = AttentionMetadata.build([1], [40], block_ids[:1], 4, DEVICE)
    ref = paged_attention(q[:1], q[:1, :2], q[:1, :2], cache, ref_meta, 0.25, GatherWorkspace())
    torch.testing.assert_close(out[:1], ref, **FP32_TOL)


# A fresh 37-token prompt, a prefix-cache hit (32 cached tokens + 13 new), a chunk in the
# middle of a prompt (40 computed, 20 new, more to come), and decodes, in one flat batch.
MIXED_QUERY = [37, 1, 13, 20, 1]
MIXED_SEQ = [37, 70, 45, 60, 3]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 2, 16, 4), (6, 2, 24, 16), (4, 4, 32, 8)],
    ids=["gqa2-d16-b4", "gqa3-d24-b16", "mha-d32-b8"],
)
def test_mixed_batch_matches_reference(heads, kv_heads, head_dim, block_size):
    out, ref, tri_cache, ref_cache = run_both(
        MIXED_QUERY, MIXED_SEQ, heads, kv_heads, head_dim, block_size, torch.float32
    )
    assert torch.equal(tri_cache, ref_cache)
    torch.testing.assert_close(out, ref, **FP32_TOL)


def test_mixed_batch_bf16_matches_reference():
    out, ref, _, _ = run_both(MIXED_QUERY, MIXED_SEQ, 4, 2, 32, 8, torch.bfloat16, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


def test_kernel_batch_tensors():
    meta = AttentionMetadata.build(
        [3, 1, 2], [3, 9, 6], [[5], [1, 2, 3], [7, 4]], 4, DEVICE, triton_num_kv_heads=2
    )
    kb = meta.kernel_batch
    assert kb is not None and meta.decode_groups == [] and meta.decode_batch is None
    assert kb.block_tables.dtype == torch.int32
    assert kb.query_start_loc.tolist() == [0, 3, 4, 6]
    assert kb.seq_lens.tolist() == [3, 9, 6]
    assert kb.block_tables.tolist() == [[5, 0, 0], [1, 2, 3], [7, 4, 0]]
    assert kb.decode_indices.tolist() == [1]
    assert kb.prefill_indices.tolist() == [0, 2]
    assert (kb.max_query_len, kb.num_splits) == (3, 1)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 12, 16, 17]


def test_choose_num_splits():
    from engine.kernels.triton_decode import choose_num_splits

    # 132 SMs (H100 SXM): one sequence x 8 KV heads wants 33 splits; capped by length and 16
    assert choose_num_splits(1, 8, 1024, 132) == 4
    assert choose_num_splits(1, 8, 100_000, 132) == 16
    assert choose_num_splits(8, 8, 4096, 132) == 5
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(0, 8, 0, 132) == 1


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests/engine/triton_sm90_compile.py")],
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": root}, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    kernels = ("write_kv", "decode_splits1", "decode_splits8", "merge", "prefill")
    assert sorted(usage) == sorted(f"{m}/{k}" for m in ("llama8b", "smollm2") for k in kernels)
    for name, u in usage.items():
        assert u["stack"] == 0 and u["local"] == 0, f"{name} spills registers: {u}"
        assert u["regs"] <= 255, name


def test_engine_greedy_tokens_match_torch_backend(tiny_model_factory):
    # Tiny Llama (4 heads over 2 KV heads, head_dim 16), 4-token blocks. The first call caches
    # a prompt; the second reuses its prefix blocks and chunks a long prompt (16-token budget)
    # next to running decodes.
    model_dir = tiny_model_factory("llama")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (12,), generator=g).tolist()
    first = [shared + torch.randint(3, 512, (5,), generator=g).tolist()]
    second = [
        shared + torch.randint(3, 512, (9,), generator=g).tolist(),
        torch.randint(3, 512, (40,), generator=g).tolist(),
    ]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model_dir, dtype="float32", device=DEVICE.type, attention_backend=backend,
            block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, load_progress=False,
        )  # fmt: skip
        assert llm.engine.runner.use_triton == (backend == "triton")
        outs = llm.generate(first, params) + llm.generate(second, params)
        tokens[backend] = [o.token_ids for o in outs]
        assert llm.engine.kv.prefix_stats.num_hits == 12  # the shared prefix: 3 full blocks
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["triton"])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
class TestOnCuda:
    """Real shapes in bf16, compiled, against the torch reference computed in fp32 from the same
    bf16 values."""

    @pytest.mark.parametrize("num_splits", [1, None])
    def test_decode_llama8b_shapes(self, num_splits):
        # 32 sequences, contexts up to 4k, 32 query heads over 8 KV heads, head_dim 128
        g = torch.Generator().manual_seed(0)
        seq_lens = torch.randint(1, 4097, (32,), generator=g).tolist()
        out, ref, tri_cache, ref_cache = run_both(
            [1] * 32, seq_lens, 32, 8, 128, 16, torch.bfloat16, num_splits, ref_fp32=True
        )
        assert torch.equal(tri_cache.float(), ref_cache)
        torch.testing.assert_close(out.float(), ref, **BF16_TOL)

    @pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)], ids=["llama8b", "smollm2"])
    def test_prefill_mixed_batch(self, shape):
        # a 2k prompt, 512 new tokens over a 1k cached prefix, a 256-token chunk at 3k, decodes
        heads, kv_heads, head_dim = shape
        query_lens = [2048, 512, 256, 1, 1]
        seq_lens = [2048, 1536, 3328, 900, 4000]
        out, ref, _, _ = run_both(
            query_lens, seq_lens, heads, kv_heads, head_dim, 16, torch.bfloat16, ref_fp32=True
        )
        torch.testing.assert_close(out.float(), ref, **BF16_TOL)

    def test_cuda_graph_decode_gives_eager_tokens(self, tiny_model_factory):
        model_dir = tiny_model_factory("llama")
        prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        tokens = {}
        for eager in (True, False):
            llm = LLM(
                model_dir, dtype="float32", device="cuda", enforce_eager=eager,
                num_kv_blocks=128, max_num_seqs=8, max_model_len=256, load_progress=False,
            )  # fmt: skip
            assert (llm.engine.runner.decode_graphs is None) == eager
            tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        assert tokens[False] == tokens[True]

    def test_kv_pool_sized_from_free_memory(self, tiny_model_factory):
        from engine.kv_sizing import kv_cache_bytes_per_block, num_kv_blocks_for_gpu_memory

        llm = LLM(
            tiny_model_factory("llama"), dtype="bfloat16", device="cuda", num_kv_blocks=4,
            load_progress=False,
        )  # fmt: skip
        model = llm.engine.runner.model
        blocks = num_kv_blocks_for_gpu_memory(
            model, 16, torch.bfloat16, DEVICE, 0.5, 2048, use_triton=True
        )
        free, total = torch.cuda.mem_get_info()
        block_bytes = kv_cache_bytes_per_block(2, 16, model.num_kv_heads, 16, torch.bfloat16)
        assert 0 < blocks * block_bytes <= 0.5 * total
        assert blocks * block_bytes > 0.5 * total - (total - free) - (1 << 30)
