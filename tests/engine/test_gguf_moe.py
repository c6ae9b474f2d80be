"""Mixture-of-experts GGUF files (engine/gguf_moe.py), written as llama.cpp's converter writes
them from the tiny HF models of tests/engine/test_moe.py: Mixtral (architecture "llama" with
experts, q/k rows permuted), Qwen2-MoE (a shared expert with its gate, a dense layer between
sparse ones) and Qwen3-MoE (q/k norms). Each expert's projections are one 3-D tensor per
layer. Loaded from F32 tensors, a model gives exactly the greedy tokens and logprobs of the
same model loaded from its safetensors (fp32); quantized Q8_0 experts come out per expert,
dequantized as a 2-D tensor of that type would be, or kept quantized with `quantization="gguf"`."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from duet.engine import LLM, SamplingParams
from duet.engine.gguf_loader import load_gguf
from duet.engine.quant.formats import QuantizedWeight
from tests.engine.gguf_files import (
    _GGUF_GLOBAL_NAMES,
    _GGUF_LAYER_NAMES,
    BYTE_LEVEL_MERGES,
    BYTE_LEVEL_SPECIALS,
    byte_level_tokens,
    encode,
    expected_dequantized,
    permute_like_llama_cpp,
)

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GLOBAL = _GGUF_GLOBAL_NAMES
_LAYER = {
    **_GGUF_LAYER_NAMES,  # the dense parts, as tests/engine/gguf_files.py writes them
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
_EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip


def _gguf_tensors(hf: dict[str, np.ndarray], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's names and layout: experts stacked [E, out, in] per layer and projection."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, w in hf.items():
        stem, suffix = name.rsplit(".", 1)
        if stem in _GLOBAL:
            out[f"{_GLOBAL[stem]}.{suffix}"] = w
            continue
        _, _, layer, part = stem.split(".", 3)
        if ".experts." in part:
            head, index, proj = part.rsplit(".", 2)
            del head
            stacks.setdefault(f"blk.{layer}.{_EXPERT_PROJ[proj]}.{suffix}", {})[int(index)] = w
            continue
        if arch == "mixtral" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg["num_attention_heads" if "q_proj" in part else "num_key_value_heads"]
            w = permute_like_llama_cpp(w, heads)
        out[f"blk.{layer}.{_LAYER[part]}.{suffix}"] = w
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _add_vocab(writer: gguf.GGUFWriter, size: int) -> None:
    """gguf_files' byte-level vocabulary, padded with user-defined tokens to one per
    embedding row."""
    base = byte_level_tokens()
    tokens = base + [f"<extra_{i}>" for i in range(size - len(base))]
    specials = len(BYTE_LEVEL_SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3] * specials + [1] * (len(base) - specials - 1) + [4] * (size - len(base) + 1)
    )
    writer.add_token_merges(BYTE_LEVEL_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_moe_gguf(model_dir: str, arch: str, path: Path, expert_type: Q = Q.F32) -> dict:
    """The GGUF file of the HF model in `model_dir`; returns its GGUF-named tensors."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    tensors = _gguf_tensors(hf, cfg, arch)
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _add_vocab(writer, cfg["vocab_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for name, w in tensors.items():
        qtype = expert_type if w.ndim == 3 else Q.F32
        data = encode(w, qtype)
        writer.add_tensor(name, data, raw_shape=None if qtype == Q.F32 else data.shape,
                          raw_dtype=None if qtype == Q.F32 else qtype)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_moe_gguf_gives_the_safetensors_models_tokens(tiny_model_factory, tmp_path, arch):
    model_dir = tiny_model_factory(arch)
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(model_dir, arch, path)
    hf_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    loaded = load_gguf(str(path))
    config = loaded.hf_config
    assert config["architectures"] == hf_cfg["architectures"]
    experts = hf_cfg.get("num_local_experts") or hf_cfg["num_experts"]
    assert loaded.num_experts == experts
    if arch != "mixtral":
        assert config["moe_intermediate_size"] == hf_cfg["moe_intermediate_size"]
        assert config["norm_topk_prob"] == hf_cfg["norm_topk_prob"]
        assert config["mlp_only_layers"] == hf_cfg.get("mlp_only_layers", [])
    assert_same_outputs(model_dir, str(path), lambda llm: llm.engine.runner.model.config.moe)


def assert_same_outputs(model_dir: str, path: str, check) -> None:
    """The safetensors model and its GGUF (fp32) give exactly the same greedy tokens and top-3
    logprobs for three prompts; `check(llm)` must hold for each loaded engine."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 33, 70)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    outs = {}
    for source in (model_dir, path):
        llm = LLM(source, dtype="float32", load_progress=False, num_kv_blocks=64)
        assert check(llm)
        outs[source] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for a, b in zip(outs[model_dir], outs[path], strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            assert [t.logprob for t in x.top] == [t.logprob for t in y.top]


def test_q8_0_experts_come_out_per_expert(tiny_model_factory, tmp_path):
    arch = "qwen3_moe"
    model_dir = tiny_model_factory(arch)
    path = tmp_path / "q8.gguf"
    tensors = write_moe_gguf(model_dir, arch, path, expert_type=Q.Q8_0)
    loaded = load_gguf(str(path))
    experts = 16
    weights = dict(loaded.weights())
    stacked = tensors["blk.1.ffn_down_exps.weight"]
    for e in (0, 7, 15):
        got = weights[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(got, expected_dequantized(stacked[e], Q.Q8_0))
    expert_names = [n for n in weights if ".experts." in n]
    assert len(expert_names) == 2 * 3 * experts  # layers x projections x experts
    assert loaded.num_tensors == len(weights)
    kept = dict(loaded.quantized_weights())
    assert all(isinstance(kept[n], QuantizedWeight) for n in expert_names)
    llm = LLM(str(path), dtype="float32", quantization="gguf", load_progress=False,
              num_kv_blocks=64)  # fmt: skip
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
