"""Deterministic inference (issue 19): a request's tokens and logprobs do not depend on what
else is in the batch, on how its prompt is chunked, or on a prefix-cache hit, in bf16 as in
fp32: bitwise, not within a tolerance.

The models are random, of every supported architecture, with SmolLM2's layer shapes (hidden
576, MLP 1536, 9 query and 3 KV heads of 64): the linear kernels' choice of code path depends
on the shapes, and the tiny test models' shapes happen to hide the differences these tests are
for."""

from __future__ import annotations

import random

import pytest

from duet.engine import LLM, SamplingParams
from duet.engine.model import row_invariant
from duet.engine.model.dense_cpu_linear import use_dense_kernel
from tests.conftest import SMOLLM2_SHAPES

DTYPES = ["bfloat16", "float32"]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2", "mistral", "llama3", "smollm2"])
def model_path(request, tiny_model_factory) -> str:
    """Every supported architecture: Llama 2, Qwen3 (q/k norms), Qwen2 (q/k/v biases), Mistral,
    Llama 3 (its rope scaling), SmolLM2 (a tied LM head)."""
    return tiny_model_factory(request.param, **SMOLLM2_SHAPES)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)


def _result(out) -> tuple[list[int], list]:
    sample = out.outputs[0]
    lps = [
        (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in sample.logprobs
    ]
    return sample.token_ids, lps


def _llm(path: str, dtype: str, **kw) -> LLM:
    kw.setdefault("deterministic", True)  # the CPU's default; CUDA's is off (too costly there)
    return LLM(path, dtype=dtype, load_progress=False, num_kv_blocks=800, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alone_equals_inside_a_batch_of_31_others(model_path, dtype):
    llm = _llm(model_path, dtype, max_num_seqs=32)
    assert llm.engine.deterministic
    rng = random.Random(0)
    prompt = _prompt(rng, 300)  # several attention partitions
    alone = _result(llm.generate([prompt], PARAMS)[0])
    others = [_prompt(rng, rng.randrange(1, 90)) for _ in range(31)]
    batch = llm.generate([*others[:13], prompt, *others[13:]], PARAMS)
    assert _result(batch[13]) == alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_and_prefix_hits_equal_one_cold_prefill(model_path, dtype):
    rng = random.Random(1)
    prompt = _prompt(rng, 161)  # 10 blocks and one token: a hit runs the decode kernel
    llm = _llm(model_path, dtype, max_num_batched_tokens=256)
    cold = _result(llm.generate([prompt], PARAMS)[0])
    assert _result(llm.generate([prompt], PARAMS)[0]) == cold  # hit: the last token runs
    for chunk in (7, 16, 61):
        chunked = _llm(model_path, dtype, max_num_batched_tokens=chunk)
        assert _result(chunked.generate([prompt], PARAMS)[0]) == cold, chunk
    longer = prompt[:150] + _prompt(rng, 5)
    cold_longer = _result(_llm(model_path, dtype).generate([longer], PARAMS)[0])
    assert _result(llm.generate([longer], PARAMS)[0]) == cold_longer  # hit: 11 tokens run


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    layer = row_invariant.Linear(1536, 576, bias=False).to(dt)  # SmolLM2's down_proj
    model = torch.nn.Sequential(layer)
    use_dense_kernel(model)  # bf16 without native bf16: duet's kernel from the start
    invariance = row_invariant.check_model(model, dt)
    # bf16: a padded vendor GEMM where that is invariant (AVX512-BF16 EPYC), else duet's kernel.
    # fp32: MKL unpadded where that is invariant, else duet's kernel, never a padded MKL (the
    # kernel is faster than MKL on 16 rows: check_model's docstring).
    assert invariance.ok and invariance.failed == []
    assert row_invariant.probe(layer, 1536, dt)
    on_kernel = layer.cpu_kernel is not None
    assert invariance.num_on_kernel == (1 if on_kernel and dt == torch.float32 else 0)
    if dt == torch.float32:
        assert layer.min_rows == 1
    assert layer.min_rows == 1 if on_kernel else layer.min_rows in (1, 8, 16)


def test_opting_out_runs_products_on_the_batch_rows_only(model_path):
    llm = _llm(model_path, "bfloat16", deterministic=False)
    assert not llm.engine.deterministic
    layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "min_rows")]
    assert layers and all(m.min_rows == 1 for m in layers)
    on = _llm(model_path, "bfloat16")
    assert all(m.min_rows in row_invariant.MIN_ROWS_CANDIDATES for m in
               on.engine.runner.model.modules() if hasattr(m, "min_rows"))  # fmt: skip


def assert_alone_batched_chunked_and_hits_equal(llm: LLM, chunked: LLM) -> None:
    """Tokens and top-5 logprobs, bitwise: a 161-token prompt cold, again (a prefix hit: its
    last token runs as a decode), among 15 others, and prefilled in chunks (`chunked`, an engine
    with a small token budget); a prompt sharing 100 tokens with it after the hit and cold in
    chunks. The mixtures' and DeepSeek's tests (test_moe.py, test_deepseek.py) run it."""
    assert llm.engine.deterministic and chunked.engine.deterministic
    rng = random.Random(0)
    prompt = _prompt(rng, 161)
    cold = _result(llm.generate([prompt], PARAMS)[0])
    assert _result(llm.generate([prompt], PARAMS)[0]) == cold  # hit
    others = [_prompt(rng, rng.randrange(1, 60)) for _ in range(15)]
    batch = llm.generate([*others[:6], prompt, *others[6:]], PARAMS)
    assert _result(batch[6]) == cold
    assert _result(chunked.generate([prompt], PARAMS)[0]) == cold
    longer = prompt[:100] + _prompt(rng, 5)
    assert _result(llm.generate([longer], PARAMS)[0]) == _result(
        chunked.generate([longer], PARAMS)[0]
    )
