"""bf16 projections with weights packed into oneDNN's layout (engine/model/packed_linear.py)
against F.linear on the same weights, and a packed bf16 model against the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.model.packed_linear import PackedLinear, can_pack, pack_linears, packing_supported

needs_packing = pytest.mark.skipif(
    not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
    reason="packed bf16 linears need a CPU with AVX512-BF16 or AMX and oneDNN's linear ops",
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(64, 96, False), (48, 40, True)])
def test_packed_linear_equals_f_linear(rows, in_features, out_features, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = PackedLinear.from_weight(w, b)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # bf16 output: one rounding of an fp32 accumulation (order may differ from the reference)
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)


@needs_packing
def test_packed_linear_takes_strided_rows_and_leading_dims():
    w = torch.randn(32, 16).to(torch.bfloat16)
    wide = torch.randn(5, 32).to(torch.bfloat16)
    x = wide[:, :16]  # rows with a stride, as silu_and_mul's view of gate_up
    layer = PackedLinear.from_weight(w)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1.6e-2, atol=1e-2)
    batch = torch.randn(2, 3, 16).to(torch.bfloat16)
    assert layer(batch).shape == (2, 3, 32)


@needs_packing
def test_pack_linears_swaps_only_bf16_cpu_layers():
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)


@needs_packing
def test_packed_bf16_model_matches_the_plain_one(tiny_llama, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    packed = LLM(tiny_llama, dtype="bfloat16", load_progress=False)
    layers = packed.engine.runner.model.layers
    assert isinstance(layers[0].mlp.gate_up_proj, PackedLinear)
    got = packed.generate(prompts, params)
    monkeypatch.setenv("DUET_CPU_KERNELS", "0")
    plain = LLM(tiny_llama, dtype="bfloat16", load_progress=False, attention_backend="torch")
    assert isinstance(plain.engine.runner.model.layers[0].mlp.gate_up_proj, nn.Linear)
    want = plain.generate(prompts, params)
    # bf16 on two code paths: the first tokens' logprobs agree to bf16 precision
    for g, w in zip(got, want, strict=True):
        assert g.token_ids[0] == w.token_ids[0]
        assert abs(g.logprobs[0].sampled.logprob - w.logprobs[0].sampled.logprob) < 0.05


def test_bf16_model_packs_exactly_where_the_cpu_supports_it(tiny_llama):
    """On a CPU without native bf16 (AVX2-only, say) the model keeps plain layers and runs."""
    llm = LLM(tiny_llama, dtype="bfloat16", load_progress=False)
    layer = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, PackedLinear) is packing_supported()
    assert isinstance(layer, nn.Linear) is not packing_supported()
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4
