"""duet's Triton kernels at the shapes they serve: Llama-3.1-8B's (32 query heads over 8 KV heads,
head_dim 128) and SmolLM2-135M's (9 over 3, head_dim 64), 16-token blocks, with the launch
configurations a GPU gets (tile sizes, warps, the split count).

Without CUDA they run in Triton's interpreter. Its `tl.dot` multiplies the raw bits of 16-bit
floats, so there the kernels multiply in fp32 after rounding every operand (the softmax
probabilities included) to the cache's dtype: bf16 numerics, emulated (triton_operands). With
CUDA the same cases run compiled, plus larger batches (`TestOnCuda`).
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from tests.engine.triton_cases import (
    BF16_TOL,
    FP32_TOL,
    ON_CUDA,
    run_both,
    triton_interpreter,  # noqa: F401 (autouse fixture)
)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

# (query heads, KV heads, head_dim)
LLAMA8B = (32, 8, 128)
SMOLLM2 = (9, 3, 64)


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The launch configurations a GPU gets, in the interpreter too (only the `tl.dot` type
    stays the interpreter's)."""
    from duet.engine.kernels import triton_decode, triton_prefill
    from duet.engine.kernels.triton_operands import dot_dtype

    cuda = torch.device("cuda")
    for module, name in ((triton_decode, "decode_launch_config"), (triton_prefill, "prefill_launch_config")):  # fmt: skip
        launch_config = getattr(module, name)

        def on_gpu(group, head_dim, dtype, device, _config=launch_config):
            return {**_config(group, head_dim, dtype, cuda), "DOT_DTYPE": dot_dtype(dtype, device)}

        monkeypatch.setattr(module, name, on_gpu)


def check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **FP32_TOL)
    else:
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, **BF16_TOL)


# NOTE: in the interpreter each case costs seconds; `make test` runs one case per kernel path
# (both dtypes' operand paths, split and unsplit decode) and `make gpu-check` all of them,
# compiled (the `sweep` marker, docs/development.md).
SWEEP = pytest.mark.sweep


@pytest.mark.parametrize(
    ("dtype", "num_splits"),
    [
        pytest.param(torch.bfloat16, 16, id="bf16-16"),
        pytest.param(torch.float32, 1, id="fp32-1"),
        pytest.param(torch.bfloat16, 1, id="bf16-1", marks=SWEEP),
        pytest.param(torch.float32, 16, id="fp32-16", marks=SWEEP),
    ],
)
def test_decode_llama8b_shape(gpu_tiles, dtype, num_splits):
    # one token of context, one block boundary, a split of one tile, and a long context
    out, ref, tri_cache, ref_cache = run_both(
        [1] * 4, [1, 17, 300, 1100], *LLAMA8B, 16, dtype, num_splits, ref_fp32=True
    )
    assert torch.equal(tri_cache.float(), ref_cache)
    check(out, ref, dtype)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, id="bf16", marks=SWEEP), pytest.param(torch.float32, id="fp32")],
)
def test_mixed_batch_smollm2_shape(gpu_tiles, dtype):
    # a fresh prompt over two query tiles, a prefix hit, a chunk mid-prompt, decodes (split 4)
    out, ref, _, _ = run_both(
        [150, 40, 70, 1, 1], [150, 300, 230, 9, 400], *SMOLLM2, 16, dtype, 4, ref_fp32=True
    )
    check(out, ref, dtype)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32", marks=SWEEP)],
)
def test_prefill_llama8b_shape(gpu_tiles, dtype):
    # a prompt filling more than one 128-row query tile (32 tokens x 4 heads each) next to a
    # 20-token chunk over 100 cached tokens
    out, ref, _, _ = run_both([45, 20], [45, 120], *LLAMA8B, 16, dtype, ref_fp32=True)
    check(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
class TestOnCuda:
    """Real shapes and batches in bf16, compiled, against the torch reference computed in fp32
    from the same bf16 values."""

    @pytest.mark.parametrize("num_splits", [1, 7, 16, None])
    def test_decode_llama8b_shapes(self, num_splits):
        # 32 sequences, contexts up to 4k, 32 query heads over 8 KV heads, head_dim 128
        g = torch.Generator().manual_seed(0)
        seq_lens = torch.randint(1, 4097, (32,), generator=g).tolist()
        out, ref, tri_cache, ref_cache = run_both(
            [1] * 32, seq_lens, *LLAMA8B, 16, torch.bfloat16, num_splits, ref_fp32=True
        )
        assert torch.equal(tri_cache.float(), ref_cache)
        torch.testing.assert_close(out.float(), ref, **BF16_TOL)

    @pytest.mark.parametrize("shape", [LLAMA8B, SMOLLM2], ids=["llama8b", "smollm2"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
    def test_prefill_mixed_batch(self, shape, dtype):
        # a 2k prompt, 512 new tokens over a 1k cached prefix, a 256-token chunk at 3k, decodes
        query_lens = [2048, 512, 256, 1, 1]
        seq_lens = [2048, 1536, 3328, 900, 4000]
        out, ref, _, _ = run_both(query_lens, seq_lens, *shape, 16, dtype, ref_fp32=True)
        check(out, ref, dtype)
