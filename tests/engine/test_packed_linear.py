"""Projections with weights packed into oneDNN's layout (engine/model/packed_linear.py) against
F.linear on the same weights, and packed models against plain ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from duet.engine import LLM, SamplingParams
from duet.engine.model.packed_linear import PackedLinear, can_pack, pack_linears, packing_supported

needs_bf16_packing = pytest.mark.skipif(
    not packing_supported(torch.bfloat16),
    reason="packed bf16 linears need a CPU with AVX512-BF16 or AMX and oneDNN's linear ops",
)
# fp32 packing works on any x86 CPU with oneDNN; whether the engine uses it is a choice per CPU
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)
# bf16 output is one rounding of an fp32 accumulation (its order may differ from F.linear's)
TOLERANCE = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
DTYPES = [
    pytest.param(torch.bfloat16, id="bf16", marks=needs_bf16_packing),
    pytest.param(torch.float32, id="fp32", marks=needs_onednn),
]


@pytest.fixture
def fp32_packing(monkeypatch):
    """Set DUET_PACK_FP32 for one test (the probe's cached answer is dropped around it)."""

    def choose(value: str) -> None:
        monkeypatch.setenv("DUET_PACK_FP32", value)
        packing_supported.cache_clear()

    yield choose
    packing_supported.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(64, 96, False), (48, 40, True)])
def test_packed_linear_equals_f_linear(dtype, rows, in_features, out_features, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = PackedLinear.from_weight(w, b)(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_takes_strided_rows_and_leading_dims(dtype):
    w = torch.randn(32, 16).to(dtype)
    wide = torch.randn(5, 32).to(dtype)
    x = wide[:, :16]  # rows with a stride, as silu_and_mul's view of gate_up
    layer = PackedLinear.from_weight(w)
    torch.testing.assert_close(layer(x), F.linear(x, w), **TOLERANCE[dtype])
    batch = torch.randn(2, 3, 16).to(dtype)
    assert layer(batch).shape == (2, 3, 32)


@needs_onednn
@pytest.mark.parametrize("choice", ["1", "0"])
def test_pack_linears_swaps_the_layers_this_cpu_packs(fp32_packing, choice):
    fp32_packing(choice)
    model = nn.Sequential(
        nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float16)
    )
    packed = [packing_supported(torch.bfloat16), choice == "1", False]
    assert pack_linears(model) == sum(packed)
    for layer, want in zip(model, packed, strict=True):
        assert isinstance(layer, PackedLinear) is want
        assert isinstance(layer, nn.Linear) is not want


@needs_bf16_packing
def test_packed_bf16_model_matches_the_plain_one(tiny_llama, request):
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    # deterministic mode on an AMX CPU takes duet's tiles instead (test_dense_linear_kernel.py)
    packed = LLM(tiny_llama, dtype="bfloat16", load_progress=False, deterministic=False)
    layers = packed.engine.runner.model.layers
    assert isinstance(layers[0].mlp.gate_up_proj, PackedLinear)
    got = packed.generate(prompts, params)
    request.getfixturevalue("cpu_kernels_off")
    plain = LLM(tiny_llama, dtype="bfloat16", load_progress=False, attention_backend="torch")
    assert isinstance(plain.engine.runner.model.layers[0].mlp.gate_up_proj, nn.Linear)
    want = plain.generate(prompts, params)
    # bf16 on two code paths: the first tokens' logprobs agree to bf16 precision
    for g, w in zip(got, want, strict=True):
        assert g.token_ids[0] == w.token_ids[0]
        assert abs(g.logprobs[0].sampled.logprob - w.logprobs[0].sampled.logprob) < 0.05


@needs_onednn
def test_packed_fp32_model_matches_the_plain_one(tiny_llama, fp32_packing):
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40)), [11] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    fp32_packing("1")
    packed = LLM(tiny_llama, dtype="float32", load_progress=False)
    model = packed.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert model.lm_head is not None or isinstance(model.tied_head, PackedLinear)
    got = packed.generate(prompts, params)
    fp32_packing("0")
    plain = LLM(tiny_llama, dtype="float32", load_progress=False)
    assert isinstance(plain.engine.runner.model.layers[0].self_attn.qkv_proj, nn.Linear)
    want = plain.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-4


def test_models_pack_exactly_where_the_cpu_supports_it(tiny_llama):
    """On a CPU without native bf16 (AVX2-only, say) a bf16 model keeps plain layers and runs;
    an fp32 model's layers take duet's dense kernel (test_dense_linear_kernel.py), never the
    packed path, unless DUET_PACK_FP32=1 asks for it (above)."""
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        llm = LLM(tiny_llama, dtype=name, load_progress=False, deterministic=False)
        layer = llm.engine.runner.model.layers[0].mlp.gate_up_proj
        packed = dtype == torch.bfloat16 and packing_supported(dtype)
        assert isinstance(layer, PackedLinear) is packed
        assert isinstance(layer, nn.Linear) is not packed
        if dtype == torch.float32:
            assert layer.cpu_kernel is not None
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0))
        assert len(out[0].token_ids) == 4
    assert can_pack(torch.empty(2, 2)) is packing_supported(torch.float32)
