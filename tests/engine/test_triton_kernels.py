"""duet's Triton kernels (engine/kernels/triton_*.py) against the torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors at tiny shapes; with CUDA the
same cases run compiled (real shapes: test_triton_real_shapes.py). A subprocess compiles every
shipped kernel variant for sm_90 (no GPU needed) to catch what the interpreter lets through.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.attention import GatherWorkspace, paged_attention, write_kv_cache
from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.triton_runtime import triton_unusable_reason
from tests.engine.triton_cases import (
    BF16_TOL,
    DEVICE,
    FP32_TOL,
    make_case,
    recorded_specializations,
    run_both,
    triton_interpreter,  # noqa: F401 (autouse fixture)
)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)


def test_triton_runs_here():
    assert triton_unusable_reason(DEVICE) is None


def test_write_kv_cache_by_slot_skips_negative_slots():
    from duet.engine.kernels.triton_cache import write_kv_cache as triton_write_kv_cache

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
    from duet.engine.kernels.triton_decode import paged_decode_attention

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


def test_decode_tiles_override_names_what_it_takes():
    from duet.engine.kernels.triton_decode import paged_decode_attention

    i32 = torch.zeros(2, dtype=torch.int32)
    kv = torch.zeros(2, 4, 16, 1, 16)
    q = torch.zeros(1, 1, 16)
    with pytest.raises(
        ValueError, match=r"tiles: only BLOCK_N, num_warps, num_stages; got \['BLOCK_D'\]"
    ):
        paged_decode_attention(q.clone(), q, kv, i32, i32[:1] + 1, i32[:1, None], i32[:1], 1.0, 1,
                               tiles={"BLOCK_D": 32})  # fmt: skip


def test_choose_num_splits():
    from duet.engine.kernels.triton_decode import choose_num_splits

    # 132 SMs (H100 SXM, H200): one sequence x 8 KV heads wants 33 splits; capped by length
    # (64 tokens a split at least) and 16
    assert choose_num_splits(1, 8, 1024, 132) == 16
    assert choose_num_splits(1, 8, 200, 132) == 4
    assert choose_num_splits(1, 8, 100_000, 132) == 16
    assert choose_num_splits(8, 8, 4096, 132) == 5
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(0, 8, 0, 132) == 1


def test_every_split_count_and_batch_reuses_one_compiled_kernel(monkeypatch):
    """A server compiles each kernel once: the split count (1 to 16, re-chosen every step), the
    batch's size (which moves the int32 views inside KernelBatch's packed buffer) and the
    block table's width change nothing Triton specialises on."""
    from duet.engine.kernels import triton_decode, triton_prefill

    batches = [  # (query_lens, seq_lens): decodes alone, one long, a mixed batch, one token
        ([1] * 3, [5, 40, 150]),
        ([1], [260]),
        ([1] * 4 + [9], [17, 33, 129, 200, 20]),
        ([1, 1], [1, 2]),
    ]
    kernels = (triton_decode._decode_kernel, triton_decode._merge_kernel)
    with recorded_specializations(monkeypatch, *kernels, triton_prefill._prefill_kernel) as keys:
        for i, (query_lens, seq_lens) in enumerate(batches):
            for num_splits in (1, 2, 3, 7, 16):
                out, ref, _, _ = run_both(
                    query_lens, seq_lens, 4, 2, 32, 8, torch.float32, num_splits
                )
                torch.testing.assert_close(out, ref, **FP32_TOL, msg=f"batch {i} {num_splits}")
    assert {name: len(k) for name, k in keys.items()} == {
        "_decode_kernel": 1,
        "_merge_kernel": 1,
        "_prefill_kernel": 1,
    }


@pytest.mark.parametrize("num_splits", [0, 17])
def test_split_count_out_of_range_is_refused(num_splits):
    from duet.engine.kernels.triton_decode import paged_decode_attention

    (cache, q, _, _), _ = make_case([1], [4], 2, 2, 16, 4, torch.float32)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    args = (torch.tensor([0, 1], **i32), torch.tensor([4], **i32), torch.zeros(1, 1, **i32))
    with pytest.raises(
        ValueError, match=r"num_splits must be in \[1, 16\]; got " + str(num_splits)
    ):
        paged_decode_attention(q, q, cache, *args, torch.tensor([0], **i32), 0.25, num_splits)


@pytest.mark.slow
def test_every_shipped_variant_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))  # and packages beside
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests/engine/triton_sm90_compile.py")],
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": path}, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    kernels = ("write_kv", "decode", "merge", "prefill", "prefill_split", "fold", "matmul",
               "matmul_bias", "rms_norm", "add_rms_norm", "rotary", "rotary_store",
               "silu_and_mul")  # fmt: skip
    dtypes = ("bfloat16", "float16", "float32")
    assert sorted(usage) == sorted(
        [f"{m}/{d}/{k}" for m in ("llama8b", "smollm2") for d in dtypes for k in kernels]
        + [f"deepseek_v3/{d}/{k}" for d in dtypes for k in ("mla", "write_latent")]
    )
    for name, u in usage.items():
        spilled = (u["spill_stores"], u["spill_loads"], u["stack"])
        assert spilled == (0, 0, 0), f"{name} spills registers: {u}"
        assert u["regs"] <= 255 and u["shared_bytes"] <= 227 * 1024, name
    # The sm_90 report, for the log: pytest -s shows it.
    print(json.dumps(usage, indent=1))


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


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k normed before the rotation
def test_engine_with_rotary_and_kv_write_in_one_kernel(tiny_model_factory, monkeypatch, arch):
    """On CUDA a Triton step rotates q and k and writes K/V in one kernel
    (`RotaryEmbedding.rotate_and_store`): here the same Triton operators, interpreted, with
    and without it, prefix hits and chunks beside decodes included: the same logprobs, bit
    for bit, and the fused kernel ran once per layer and step."""
    from duet.engine.kernels import triton_elementwise
    from duet.engine.model import rotary

    monkeypatch.setattr(rotary, "fused_ops_for", lambda x: triton_elementwise)
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        triton_elementwise.rotary_embedding_and_store(*args)

    model_dir = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (12,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 30)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for fused in (False, True):
        store = SimpleNamespace(rotary_embedding_and_store=counted) if fused else None
        monkeypatch.setattr(rotary, "fused_store_for", lambda x, store=store: store)
        llm = LLM(
            model_dir, dtype="float32", device="cpu", attention_backend="triton", block_size=4,
            num_kv_blocks=64, max_num_batched_tokens=16, load_progress=False,
        )  # fmt: skip
        outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
        runs[fused] = [(o.token_ids, [e.sampled.logprob for e in o.logprobs]) for o in outs]
    assert runs[True] == runs[False]
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert len(calls) % layers == 0 and len(calls) >= 5 * layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestOnCuda:
    """The engine on CUDA with the Triton kernels (kernels at real shapes:
    test_triton_real_shapes.py)."""

    def test_cuda_graph_decode_with_split_k_gives_eager_tokens(self, tiny_model_factory):
        # Contexts up to 700 tokens: the graphs (captured for max_model_len 1024) split them.
        model_dir = tiny_model_factory("llama")
        prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
        prompts += [[3 + i % 500 for i in range(n)] for n in (300, 690)]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        tokens = {}
        for eager in (True, False):
            llm = LLM(
                model_dir, dtype="float32", device="cuda", enforce_eager=eager,
                num_kv_blocks=512, max_num_seqs=8, max_model_len=1024, load_progress=False,
            )  # fmt: skip
            graphs = llm.engine.runner.decode_graphs
            assert (graphs is None) == eager
            if graphs is not None:  # 2 KV heads: every bucket wants more programs than 1 split
                assert set(graphs.num_splits) == {1, 2, 4, 8}
                assert min(graphs.num_splits.values()) > 1
            tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        assert tokens[False] == tokens[True]

    @pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
    def test_a_mixture_on_the_fused_kernel_replays_graphs_with_eager_tokens(
        self, tiny_model_factory, arch
    ):
        """On CUDA a mixture's sparse blocks run the fused Triton kernel, which reads nothing on
        the host, so decode steps replay graphs (MLA's latent writes skip the padding rows):
        eager's tokens in bf16 and the same expert load (padding rows not counted). With
        deterministic inference: a graph runs its bucket's padded batch (3 requests in the
        bucket of 4), and without row-invariant products cuBLAS picks its kernel by the row
        count, which on the H200 (2026-11-30) flipped a near-tie of Qwen3-MoE's at step 7."""
        prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        runs = {}
        for eager in (True, False):
            llm = LLM(
                tiny_model_factory(arch), dtype="bfloat16", device="cuda", enforce_eager=eager,
                deterministic=True, num_kv_blocks=256, max_num_seqs=8, max_model_len=512,
                load_progress=False,
            )  # fmt: skip
            runner = llm.engine.runner
            assert (runner.decode_graphs is None) == eager
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            runs[eager] = (tokens, runner.expert_load.read())
        assert runner.decode_graphs.num_replays > 0
        assert runs[False] == runs[True]

    def test_kv_pool_sized_from_free_memory(self, tiny_model_factory):
        from duet.engine.kv_sizing import num_kv_blocks_for_gpu_memory

        llm = LLM(
            tiny_model_factory("llama"), dtype="bfloat16", device="cuda", num_kv_blocks=4,
            load_progress=False,
        )  # fmt: skip
        model = llm.engine.runner.model
        blocks = num_kv_blocks_for_gpu_memory(
            model, 16, torch.bfloat16, DEVICE, 0.5, 2048, use_triton=True
        )
        free, total = torch.cuda.mem_get_info()
        block_bytes = model.kv_spec.bytes_per_block(2, 16, torch.bfloat16)
        assert 0 < blocks * block_bytes <= 0.5 * total
        assert blocks * block_bytes > 0.5 * total - (total - free) - (1 << 30)
