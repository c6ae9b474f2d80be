"""engine/quant/gguf_repack.py: GGUF quantized blocks repacked into duet's formats dequantize
bit-exactly to `gguf.quants.dequantize`; `--quantization gguf` loads them without a dense copy."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from duet.engine import LLM, SamplingParams
from duet.engine.errors import InvalidInputError
from duet.engine.gguf_loader import default_model_path, load_gguf
from duet.engine.loader import load_model
from duet.engine.model.concat_linear import ConcatLinear
from duet.engine.model.quantized_linear import QuantizedLinear
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.formats import Int4Weight, Int8Weight
from duet.engine.quant.gguf_repack import REPACKED_TYPES, repack
from tests.engine.gguf_files import Q, write_tiny_gguf

# ggml type -> (duet format, group size, symmetric)
EXPECTED = {
    Q.Q8_0: (Int8Weight, 32, True),
    Q.Q6_K: (Int8Weight, 16, True),
    Q.Q4_0: (Int4Weight, 32, True),
    Q.Q4_1: (Int4Weight, 32, False),
    Q.Q4_K: (Int4Weight, 32, False),
}
# byte offsets of each type's fp16 fields inside a block
FP16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks ([rows, bytes per row]): every bit pattern of the quantized values and
    scales, with finite fp16 scales (of both signs, and some zero)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = rng.standard_normal(raw.shape[:2]).astype(np.float16)
        values[0, 0] = 0.0
        raw[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(REPACKED_TYPES), ids=lambda t: t.name)
def test_random_blocks_dequantize_bit_exactly(qtype: Q) -> None:
    data = random_blocks(qtype, 6, 768)
    weight = repack(data, qtype)
    kind, group_size, symmetric = EXPECTED[qtype]
    assert isinstance(weight, kind) and weight.group_size == group_size
    assert getattr(weight, "symmetric", True) is symmetric
    expected = gguf.quants.dequantize(data, qtype)
    ours = weight.dequantize().numpy()
    assert ours.shape == expected.shape == (6, 768)
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_quantized_weights_dequantize_bit_exactly(qtype: Q) -> None:
    weights = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)
    expected = gguf.quants.dequantize(data, qtype)
    assert np.array_equal(repack(data, qtype).dequantize().numpy().view(np.uint32),
                          expected.view(np.uint32))  # fmt: skip


def test_embedded_smollm2_tensors_repack_bit_exactly() -> None:
    model = load_gguf(default_model_path())
    tensors = {t.name: t for t in model._reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        assert tensor.tensor_type in (Q.Q4_1, Q.Q8_0)
        data = tensor.data[:512]  # the embedding's first rows are enough
        expected = gguf.quants.dequantize(data, tensor.tensor_type)
        ours = repack(data, tensor.tensor_type).dequantize().numpy()
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), name


def quantized_types(hf_name: str) -> Q:
    """Every linear of a tiny GGUF quantized, with the types SmolLM2 and Q4_0 files use; layer
    1's q|k|v mixes Q4_1 with Q8_0 (a fused layer whose parts keep their own formats)."""
    if "layers.1.self_attn.v_proj" in hf_name or "embed_tokens" in hf_name:
        return Q.Q8_0
    if "o_proj" in hf_name:
        return Q.Q4_0
    return Q.Q4_1


def test_gguf_quantization_keeps_the_files_weights(tmp_path: Path) -> None:
    path = tmp_path / "q4.gguf"
    write_tiny_gguf(path, lm_head=True, qtypes=quantized_types)
    dense = dict(load_gguf(str(path)).weights())  # gguf's dequantization, the oracle
    config = QuantizationConfig("gguf", lm_head=True)
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), progress=False,
                        deterministic=False, quantization=config)  # fmt: skip
    net = loaded.model
    layer0, layer1 = net.layers
    fused = {
        "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "self_attn.o_proj": ["self_attn.o_proj"],
        "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
        "mlp.down_proj": ["mlp.down_proj"],
    }
    for i, layer in enumerate(net.layers):
        for ours, parts in fused.items():
            module = layer.get_submodule(ours)
            expected = torch.cat([dense[f"model.layers.{i}.{p}.weight"] for p in parts])
            if i == 1 and ours == "self_attn.qkv_proj":  # Q4_1 q, k with a Q8_0 v: each kept
                assert isinstance(module, ConcatLinear)
                qk, v = module.layers
                assert isinstance(qk, QuantizedLinear) and qk.kind == "int4"
                assert isinstance(v, QuantizedLinear) and v.kind == "int8-grouped"
                ours_w = torch.cat([qk.dequantize(torch.float32), v.dequantize(torch.float32)])
                assert torch.equal(ours_w, expected)
                continue
            assert isinstance(module, QuantizedLinear), (i, ours)
            assert module.kind == "int4"
            assert torch.equal(module.dequantize(torch.float32), expected), (i, ours)
    assert isinstance(net.lm_head, QuantizedLinear)
    assert torch.equal(net.lm_head.dequantize(torch.float32), dense["lm_head.weight"])
    assert torch.equal(net.embed_tokens.weight, dense["model.embed_tokens.weight"])
    assert isinstance(layer0.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(layer1.mlp.gate_up_proj, QuantizedLinear)


def test_gguf_quantization_serves_deterministically(tmp_path: Path) -> None:
    path = tmp_path / "q4.gguf"
    write_tiny_gguf(path, qtypes=quantized_types)
    llm = LLM(str(path), dtype="bfloat16", quantization="gguf", load_progress=False,
              num_kv_blocks=64, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.deterministic
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batch == alone and all(len(t) == 6 for t in batch)


def test_gguf_quantization_needs_a_gguf_file(tiny_llama: str) -> None:
    with pytest.raises(InvalidInputError) as error:
        load_model(tiny_llama, torch.float32, torch.device("cpu"), progress=False,
                   quantization=QuantizationConfig("gguf"))  # fmt: skip
    assert error.value.field == "quantization"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_q4_k_m_style_fused_layer_keeps_q4_k_and_q6_k(dtype: torch.dtype) -> None:
    """A Q4_K_M file's q|k|v: Q4_K q and k, a Q6_K v (with a qwen2-style bias). Each run of one
    format stays quantized in its own layer, the weights are the file's bit for bit, and each
    output row is computed on its own (alone equals in a batch, bitwise)."""
    cols = 512
    q, k = (
        repack(random_blocks(Q.Q4_K, 64, cols, 1), Q.Q4_K),
        repack(random_blocks(Q.Q4_K, 32, cols, 2), Q.Q4_K),
    )
    v = repack(random_blocks(Q.Q6_K, 32, cols, 3), Q.Q6_K)
    slot = QuantizedLinear(cols, 128, True, QuantizationConfig("gguf"))
    assert slot.bias is not None
    with torch.no_grad():
        slot.bias.copy_(torch.randn(128))
    for offset, part in ((0, q), (64, k), (96, v)):
        slot.load_part(offset, part)
    layer = slot.finalize(dtype, torch.device("cpu"))
    assert isinstance(layer, ConcatLinear)
    qk, v_layer = layer.layers
    assert isinstance(qk, QuantizedLinear) and (qk.kind, qk.out_features) == ("int4", 96)
    assert isinstance(v_layer, QuantizedLinear) and v_layer.kind == "int8-grouped"
    assert v_layer.group_size == 16
    full = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    if dtype == torch.float32:  # the fp32 path keeps the file's scales exactly
        ours = torch.cat([qk.dequantize(torch.float32), v_layer.dequantize(torch.float32)])
        assert torch.equal(ours, full)
    x = (torch.randn(5, cols) * 0.1).to(dtype)
    out = layer(x)
    assert out.shape == (5, 128) and out.dtype == dtype
    expected = F.linear(x.float(), full, slot.bias)
    scale = expected.abs().max().item()
    assert (out.float() - expected).abs().max().item() <= scale * (
        1e-5 if dtype == torch.float32 else 2e-2
    )
    assert torch.equal(layer(x[2:3]), out[2:3])
