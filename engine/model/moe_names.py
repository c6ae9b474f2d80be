"""The checkpoint names of a mixture's tensors: which expert and projection a name is, the
router's (and its correction bias's) name in the model, and every tensor a sparse layer's
checkpoint holds (for dummy weights)."""

from __future__ import annotations

import re

from duet.engine.model.arch import MoEConfig

# Checkpoint names of an expert's projections, after the "layers.N." prefix: Qwen's
# `mlp.experts.E.gate_proj` and `mlp.shared_expert.up_proj` (DeepSeek's `mlp.shared_experts.*`),
# Mixtral's `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down).
_EXPERT_NAME = re.compile(
    r"^(?P<layer>layers\.\d+\.)(?:mlp|block_sparse_moe)\.(?P<group>experts\.\d+|shared_experts?)"
    r"\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# Router tensors: the gate, Qwen2-MoE's shared-expert gate, DeepSeek-V3's score correction bias
# (ours: `mlp.e_score_correction_bias`).
_ROUTER_NAME = re.compile(
    r"^(?P<layer>layers\.\d+\.)(?:mlp|block_sparse_moe)\."
    r"(?P<name>gate\.weight|shared_expert_gate\.weight|gate\.e_score_correction_bias)$"
)
MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's expert projection names -> Qwen's (and ours)."""


def expert_placement(target: str) -> tuple[str, int | None, str] | None:
    """For an expert projection's checkpoint name (without "model."): (its layer's prefix,
    "layers.N.", the routed expert's index or None for the shared expert, the projection:
    gate_proj, up_proj or down_proj); else None."""
    match = _EXPERT_NAME.match(target)
    if match is None:
        return None
    proj = MIXTRAL_PROJ.get(match["proj"], match["proj"])
    group = match["group"]
    index = None if group.startswith("shared_expert") else int(group.removeprefix("experts."))
    return match["layer"], index, proj


def router_name(target: str) -> str | None:
    """Our name of a router (or shared-expert gate) weight, from its checkpoint name."""
    match = _ROUTER_NAME.match(target)
    if match is None:
        return None
    name = match["name"]
    if name == "gate.e_score_correction_bias":
        name = "e_score_correction_bias"  # a parameter of the block, beside the gate
    return f"{match['layer']}mlp.{name}"


def moe_weight_shapes(
    moe: MoEConfig, hidden: int, prefix: str
) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse layer's checkpoint tensors under `prefix` ("model.layers.N."): (name, shape)."""
    inter = moe.intermediate_size
    if moe.checkpoint_names == "mixtral":
        block = prefix + "block_sparse_moe."
        projs = [("w1", (inter, hidden)), ("w2", (hidden, inter)), ("w3", (inter, hidden))]
    else:
        block = prefix + "mlp."
        projs = [("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                 ("down_proj", (hidden, inter))]  # fmt: skip
    shapes: list[tuple[str, tuple[int, ...]]] = [(block + "gate.weight", (moe.num_experts, hidden))]
    for e in range(moe.num_experts):
        shapes += [(f"{block}experts.{e}.{p}.weight", shape) for p, shape in projs]
    shared = moe.shared_expert_intermediate_size
    if shared:
        name = block + (
            "shared_experts." if moe.checkpoint_names == "deepseek" else "shared_expert."
        )
        shapes += [
            (name + "gate_proj.weight", (shared, hidden)),
            (name + "up_proj.weight", (shared, hidden)),
            (name + "down_proj.weight", (hidden, shared)),
        ]
        if moe.shared_expert_gated:
            shapes.append((block + "shared_expert_gate.weight", (1, hidden)))
    if moe.topk_method == "noaux_tc":
        shapes.append((block + "gate.e_score_correction_bias", (moe.num_experts,)))
    return shapes
