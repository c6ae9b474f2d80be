"""Mixture-of-experts GGUF files, as llama.cpp's converter writes them: Mixtral (architecture
"llama" with `llama.expert_count`), Qwen2-MoE ("qwen2moe") and Qwen3-MoE ("qwen3moe").

llama.cpp stacks a layer's routed experts into one 3-D tensor per projection
(`blk.N.ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`; ggml order [in, out, experts], so the
expert is the outermost axis of the mapped array and each expert's slice is laid out as a 2-D
tensor of the same type). duet's MoE layers take one checkpoint tensor per expert (HF's names:
engine/model/moe.py), so `expert_tensors` yields each expert's slice under its HF name; a
quantized slice is repacked or dequantized exactly as a 2-D tensor would be. The router is
`ffn_gate_inp`; Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp` with its sigmoid gate
`ffn_gate_inp_shexp`.

What GGUF does not say is taken as llama.cpp runs these models: Qwen3-MoE renormalises a
token's top-k weights and Qwen2-MoE does not (unless `{arch}.expert_weights_norm` says), every
layer is sparse unless it lacks a router (Qwen's `mlp_only_layers`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duet.engine.model.moe_names import MIXTRAL_PROJ

MOE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
"""GGUF architecture -> (HF architectures entry, HF model_type); Mixtral files say "llama"."""
MIXTRAL = ("MixtralForCausalLM", "mixtral")
RENORMALIZE_BY_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True}

_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_MIXTRAL_NAME = {proj: name for name, proj in MIXTRAL_PROJ.items()}  # gate_proj -> w1, ...
_SHARED = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def is_mixtral(architecture: str, expert_count: int) -> bool:
    return architecture == "llama" and expert_count > 0


def layer_tensor_name(architecture: str, part: str) -> str | None:
    """The HF name (after "model.layers.N.") of a layer's non-expert MoE tensor `part`
    ("ffn_gate_inp", a shared expert's part), or None when `part` is not one."""
    block = "block_sparse_moe" if architecture == "llama" else "mlp"
    if part == "ffn_gate_inp":
        return f"{block}.gate"
    return _SHARED.get(part) if architecture == "qwen2moe" else None


def expert_template(architecture: str, part: str) -> str | None:
    """For a stacked expert tensor `part` ("ffn_gate_exps", ...): the HF name after
    "model.layers.N." with `{e}` for the expert; None when `part` is not one."""
    proj = _EXPERTS.get(part)
    if proj is None:
        return None
    if architecture == "llama":
        return f"block_sparse_moe.experts.{{e}}.{_MIXTRAL_NAME[proj]}"
    return f"mlp.experts.{{e}}.{proj}"


def moe_hf_config(
    architecture: str, field: Callable[[str], Any], tensor_names: set[str], num_layers: int
) -> dict[str, Any]:
    """The HF config keys of the experts, from `{arch}.*` metadata (`field` reads one without
    the prefix) and which layers have a router."""
    experts = int(field("expert_count") or 0)
    used = int(field("expert_used_count") or 0)
    if architecture == "llama":  # Mixtral: each expert is the model's feed-forward
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    norm = field("expert_weights_norm")
    config: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(field("expert_feed_forward_length")),
        "norm_topk_prob": RENORMALIZE_BY_DEFAULT[architecture] if norm is None else bool(norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ],
    }
    if architecture == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(
            field("expert_shared_feed_forward_length") or 0
        )
    return config
