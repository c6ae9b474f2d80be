"""DeepSeek-V2/V3 GGUF files (engine/gguf_deepseek.py), written as llama.cpp's converter writes
them (architecture "deepseek2") from the tiny HF DeepSeek models: experts stacked per layer and
projection, kv_b_proj whole (files from before llama.cpp's MLA support) or split into the
transposed key half and the value half (newer files), MLA's sizes as multi-query attention
over the latent entry. Loaded from F32 tensors, each gives exactly the greedy tokens and
logprobs of the same model loaded from its safetensors (fp32); with Q8_0 experts and
`quantization="gguf"`, they stay quantized. The DeepSeek-V3 and DeepSeek-LLM (V2) pre-tokenizers
split as llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from duet.engine import LLM, SamplingParams
from duet.engine.errors import ModelLoadError
from duet.engine.gguf_deepseek import kv_b_from_split
from duet.engine.gguf_loader import load_gguf
from tests.engine.gguf_files import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, encode
from tests.engine.test_deepseek import DEEPSEEK_SHAPES
from tests.engine.test_gguf_moe import _add_vocab, assert_same_outputs

Q = gguf.GGMLQuantizationType
_LAYER = {
    **_GGUF_LAYER_NAMES,  # q_proj (no q LoRA), o_proj, the dense layers' MLP, the norms
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _gguf_tensors(hf: dict[str, np.ndarray], cfg: dict, split_kv_b: bool) -> dict:
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, w in hf.items():
        stem, suffix = name.rsplit(".", 1)
        if stem in _GGUF_GLOBAL_NAMES:
            out[f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"] = w
            continue
        _, _, layer, part = stem.split(".", 3)
        if name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        elif ".experts." in part:
            _, index, proj = part.rsplit(".", 2)
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.{suffix}", {})[int(index)] = w
        elif part == "self_attn.kv_b_proj" and split_kv_b:  # llama.cpp's MLA split
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = w.reshape(heads, nope + v, w.shape[-1])
            out[f"blk.{layer}.attn_k_b.{suffix}"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1)
            )
            out[f"blk.{layer}.attn_v_b.{suffix}"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            out[f"blk.{layer}.{_LAYER[part]}.{suffix}"] = w
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def write_deepseek_gguf(
    model_dir: str,
    path: Path,
    *,
    split_kv_b: bool = True,
    expert_type: Q = Q.F32,
    pre: str = "deepseek-v3",
) -> dict:
    """The GGUF file of the HF DeepSeek model in `model_dir` (`pre`: its `tokenizer.ggml.pre`);
    returns its GGUF-named tensors."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    tensors = _gguf_tensors(hf, cfg, split_kv_b)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _add_vocab(writer, cfg["vocab_size"])
    writer.add_tokenizer_pre(pre)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    rope, nope, v, rank = (cfg[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                            "kv_lora_rank"))  # fmt: skip
    if split_kv_b:  # MLA as llama.cpp runs it: one KV head of the latent entry
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    else:
        writer.add_head_count_kv(cfg["num_attention_heads"])
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    writer.add_rope_dimension_count(rope)
    scaling = cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") == "yarn":  # the keys llama.cpp's converter writes for it
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    if cfg.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if cfg.get("n_group") is not None:
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
    sigmoid = cfg["model_type"] == "deepseek_v3"
    writer.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
    for name, w in tensors.items():
        qtype = expert_type if "_exps." in name else Q.F32
        data = encode(w, qtype)
        writer.add_tensor(name, data, raw_shape=None if qtype == Q.F32 else data.shape,
                          raw_dtype=None if qtype == Q.F32 else qtype)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "original_max_position_embeddings": 256, "mscale": 0.7, "mscale_all_dim": 0.7,
        "beta_slow": 1}  # fmt: skip
"""DeepSeek's own yarn configs give mscale and mscale_all_dim one value; GGUF keeps only
mscale_all_dim (0.1x: `yarn_log_multiplier`) and llama.cpp runs the model as if they were equal
(the tiny yarn model of tests/conftest.py has two values: not a GGUF's model)."""


@pytest.mark.parametrize(
    ("arch", "split_kv_b"),
    [("deepseek_v2", False), ("deepseek_v2_grouped", True), ("deepseek_v3", True),
     ("deepseek_v3_yarn", True)],
    ids=["v2-lite-whole-kv-b", "v2-grouped-split-kv-b", "v3-split-kv-b", "v3-yarn"],
)  # fmt: skip
def test_a_deepseek_gguf_gives_the_safetensors_models_tokens(
    tiny_model_factory, tmp_path, arch, split_kv_b
):
    extra = {"rope_parameters": YARN} if arch == "deepseek_v3_yarn" else {}
    model_dir = tiny_model_factory(arch, **DEEPSEEK_SHAPES, **extra)
    path = tmp_path / f"{arch}.gguf"
    write_deepseek_gguf(model_dir, path, split_kv_b=split_kv_b)
    hf_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    config = load_gguf(str(path)).hf_config
    for key in ("architectures", "model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                "num_key_value_heads"):  # fmt: skip
        assert config[key] == hf_cfg[key], key
    want_method = {"deepseek_v2": "greedy", "deepseek_v2_grouped": "group_limited_greedy",
                   "deepseek_v3": "noaux_tc", "deepseek_v3_yarn": "noaux_tc"}[arch]  # fmt: skip
    assert config["topk_method"] == want_method
    if extra:
        assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                          "original_max_position_embeddings": 256,
                                          "beta_slow": 1.0, "mscale": pytest.approx(0.7),
                                          "mscale_all_dim": pytest.approx(0.7)}  # fmt: skip
    assert_same_outputs(model_dir, str(path), lambda llm: llm.engine.runner.model.config.mla)


def test_q8_0_experts_stay_quantized_and_kv_b_is_whole(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    path = tmp_path / "q8.gguf"
    tensors = write_deepseek_gguf(model_dir, path, expert_type=Q.Q8_0)
    loaded = load_gguf(str(path))
    kept = dict(loaded.quantized_weights())
    assert loaded.num_tensors == len(kept)
    experts = [n for n in kept if ".mlp.experts." in n]
    assert len(experts) == 2 * 3 * 16  # two sparse layers x projections x experts
    assert all(not isinstance(kept[n], torch.Tensor) for n in experts)
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(kept[name], torch.from_numpy(hf[name]))  # put back from its halves
    assert "blk.1.attn_k_b.weight" in tensors
    llm = LLM(str(path), dtype="float32", quantization="gguf", load_progress=False,
              num_kv_blocks=64)  # fmt: skip
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_split_halves_of_another_shape_are_refused():
    with pytest.raises(ModelLoadError, match=r"attn_k_b \(4, 8, 3\) and attn_v_b \(4, 5, 7\)"):
        kv_b_from_split(torch.zeros(4, 8, 3), torch.zeros(4, 5, 7))


def test_the_deepseek_v3_pre_tokenizer_splits_as_llama_cpp(tiny_model_factory, tmp_path):
    """Digits in runs of at most three, CJK ideographs and kana in runs of their own, then
    words, punctuation with a following letter run, and spaces (llama.cpp's DEEPSEEK3_LLM)."""
    path = tmp_path / "v3.gguf"
    write_deepseek_gguf(tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES), path)
    tokenizer = load_gguf(str(path)).tokenizer()
    text = "Hello world 12345 日本語です!!\n\nfoo.Bar it's  x"
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    decoded = [tokenizer.decoder.decode([p]) for p in pieces]
    assert decoded == ["Hello", " world", " ", "123", "45", " ", "日本語です", "!!\n\n", "foo",
                       ".Bar", " it", "'s", " ", " x"]  # fmt: skip
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_the_deepseek_llm_pre_tokenizer_splits_as_llama_cpp(tiny_model_factory, tmp_path):
    """V2's six splits in turn (llama.cpp's DEEPSEEK_LLM): line breaks alone, cased-letter runs
    (not CJK), punctuation (whose ASCII range takes ASCII letters too, so it cuts a word around
    a non-ASCII letter), trailing spaces, CJK and Hangul runs, digit runs of any length.
    GPT-2's split (the fallback) would keep "Héllo" and " 12345" whole."""
    path = tmp_path / "v2.gguf"
    write_deepseek_gguf(tiny_model_factory("deepseek_v2", **DEEPSEEK_SHAPES), path,
                        split_kv_b=False, pre="deepseek-llm")  # fmt: skip
    tokenizer = load_gguf(str(path)).tokenizer()
    text = "Héllo wörld, 12345 αβγ!\n\n日本語です。한국어 it's (x)  "
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    decoded = [tokenizer.decoder.decode([p]) for p in pieces]
    assert decoded == ["H", "é", "llo", " w", "ö", "rld", ",", " ", "12345", " αβγ", "!", "\n",
                       "\n", "日本語です", "。", "한국어", " it", "'", "s", " (", "x", ")",
                       "  "]  # fmt: skip
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_a_tensor_parallel_rank_reads_its_heads_of_the_put_back_kv_b(tiny_model_factory, tmp_path):
    """TP=2 from the GGUF (kv_b_proj put back whole from its halves, each rank then keeping
    its heads' rows) gives TP=2 from safetensors' tokens and logprobs exactly."""
    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    path = tmp_path / "v3.gguf"
    write_deepseek_gguf(model_dir, path)
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = []
    for source in (model_dir, str(path)):
        llm = LLM(source, dtype="float32", load_progress=False, num_kv_blocks=64,
                  tensor_parallel_size=2)  # fmt: skip
        outs.append([o.outputs[0] for o in llm.generate(prompts, params)])
        llm.shutdown()
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        assert [[t.logprob for t in x.top] for x in a.logprobs] == [
            [t.logprob for t in y.top] for y in b.logprobs
        ]
