"""DeepSeek-V2 and V3 GGUF files, as llama.cpp's converter writes both: architecture
"deepseek2", multi-head latent attention and DeepSeek's mixture of experts.

What maps onto HF's DeepSeek classes (engine/model/mla.py, moe.py):

- **Which version**: GGUF does not say. V3 scores experts with a sigmoid
  (`deepseek2.expert_gating_func` 2) and carries a score correction bias per layer
  (`blk.N.exp_probs_b.bias`), routed as `noaux_tc`; V2 scores with a softmax, group-limited
  when `expert_group_count` > 1 (V2's `group_limited_greedy`), else greedy (V2-Lite).
- **Attention sizes**: llama.cpp writes MLA as multi-query attention over the latent entry:
  `attention.key_length` kv_lora_rank + rope dims and `value_length` kv_lora_rank, with the
  per-head sizes in `key_length_mla` / `value_length_mla` (files from before llama.cpp's MLA
  support have the per-head sizes in `key_length` / `value_length` and no `_mla` keys).
  `rope.dimension_count` is qk_rope_head_dim; HF's num_key_value_heads is the head count.
- **kv_b_proj**: older files hold it whole (`attn_kv_b`); newer ones split it per head into
  `attn_k_b` (the key half, transposed: [heads, kv_lora_rank, qk_nope] in torch order) and
  `attn_v_b` ([heads, v_head_dim, kv_lora_rank]). The split pair is put back together
  (`kv_b_from_split`), dequantized: the loader absorbs kv_b_proj into per-head products anyway.
- **Rotary embedding**: llama.cpp rotates DeepSeek's rope dims as adjacent pairs (its "norm"
  rope) on weights the converter does not permute, which is HF's interleaved rope: no rows move.
- **YaRN**: `rope.scaling.yarn_log_multiplier` is 0.1 x HF's `mscale_all_dim`; DeepSeek's
  configs give `mscale` the same value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from duet.engine.errors import ModelLoadError

DEEPSEEK2 = "deepseek2"
V2 = ("DeepseekV2ForCausalLM", "deepseek_v2")
V3 = ("DeepseekV3ForCausalLM", "deepseek_v3")
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)

LAYER_TENSORS = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",  # with attn_v_b: `kv_b_from_split`
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
"""A layer's DeepSeek-only tensors (the rest as Llama's) -> HF's names after
"model.layers.N."."""
SPLIT_VALUE_HALF = "attn_v_b"
"""Read with its `attn_k_b` (it yields no weight of its own)."""
CORRECTION_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")
"""V3's per-expert score correction: `blk.N.exp_probs_b.bias`, a name without a suffix in HF."""


def deepseek_hf_config(
    field: Callable[[str], Any], tensor_names: set[str], base: dict[str, Any]
) -> dict[str, Any]:
    """The HF config keys of a DeepSeek GGUF (`field` reads `deepseek2.*` without the prefix)
    over the Llama-style `base` (hidden size, layers, heads, rope, vocabulary)."""

    def required(key: str) -> Any:
        value = field(key)
        if value is None:
            raise ModelLoadError(f"{DEEPSEEK2}.{key}: missing from the GGUF metadata")
        return value

    rope_dims = int(required("rope.dimension_count"))
    kv_lora_rank = int(required("attention.kv_lora_rank"))
    if field("attention.key_length_mla") is not None:
        key_length = int(field("attention.key_length_mla"))
        value_length = int(required("attention.value_length_mla"))
    else:  # converted before llama.cpp's MLA support: the per-head sizes
        key_length = int(required("attention.key_length"))
        value_length = int(required("attention.value_length"))
    v3 = int(field("expert_gating_func") or 1) == SIGMOID_GATING or any(
        name.endswith(".exp_probs_b.bias") for name in tensor_names
    )
    groups = int(field("expert_group_count") or 1)
    experts = int(required("expert_count"))
    arch, model_type = V3 if v3 else V2
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "num_key_value_heads": base["num_attention_heads"],  # HF's MLA: every head
        "head_dim": rope_dims,  # as HF's DeepSeek configs set it
        "q_lora_rank": int(field("attention.q_lora_rank") or 0) or None,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": key_length - rope_dims,
        "qk_rope_head_dim": rope_dims,
        "v_head_dim": value_length,
        "n_routed_experts": experts,
        "num_experts_per_tok": int(required("expert_used_count")),
        "moe_intermediate_size": int(required("expert_feed_forward_length")),
        "n_shared_experts": int(field("expert_shared_count") or 0),
        "first_k_dense_replace": int(field("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(field("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(field("expert_weights_norm") or False),
        "n_group": groups,
        "topk_group": int(field("expert_group_used_count") or groups),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
    }
    if v3:
        config["rope_interleave"] = True  # llama.cpp's rope on unpermuted weights (docstring)
    scaling = base.get("rope_scaling")
    log_mul = field("rope.scaling.yarn_log_multiplier")
    if scaling is not None and scaling.get("rope_type") == "yarn" and log_mul is not None:
        mscale = float(log_mul) / 0.1
        config["rope_scaling"] = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return config


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's kv_b_proj [heads * (qk_nope + v_head_dim), kv_lora_rank] from llama.cpp's split
    halves: k_b [heads, kv_lora_rank, qk_nope] (transposed) and v_b [heads, v_head_dim,
    kv_lora_rank]; each head's key rows, then its value rows."""
    heads, rank, _ = k_b.shape
    if v_b.dim() != 3 or v_b.shape[0] != heads or v_b.shape[2] != rank:
        raise ModelLoadError(
            f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)}: the halves of one "
            "kv_b_proj must share heads and kv_lora_rank"
        )
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank).contiguous()
