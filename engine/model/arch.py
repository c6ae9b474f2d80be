"""`ModelArchConfig`: the shape of a Llama-family model, read from an HF config.json dict, with
`MoEConfig` for the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) and
`MLAConfig` for DeepSeek's multi-head latent attention."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from duet.engine.errors import ModelLoadError

# HF architecture name -> the features it switches on.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "MixtralForCausalLM": {"moe": True},
    "Qwen2MoeForCausalLM": {"moe": True, "attention_bias": True, "shared_expert": True},
    "Qwen3MoeForCausalLM": {"moe": True, "qk_norm": True},
    "DeepseekV2ForCausalLM": {"moe": True, "mla": True},
    "DeepseekV3ForCausalLM": {"moe": True, "mla": True},
}

_DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

BASE_MODELS: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""A decoder without its LM head (HF's base class: the checkpoints of embedding models such as
e5-mistral, gte-Qwen2 and Qwen3-Embedding) -> the architecture whose layers it has. Such a
model computes embeddings only (`ModelArchConfig.embedding_only`)."""


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a mixture-of-experts model, as its HF config defines them."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    """Each routed expert's (HF's `moe_intermediate_size`; Mixtral's `intermediate_size`)."""
    renormalize: bool
    """Whether a token's top-k routing weights are divided by their sum (Mixtral always;
    Qwen's `norm_topk_prob`)."""
    weights_in_model_dtype: bool
    """Whether the routing weights are cast to the activations' dtype before they scale an
    expert's output (Qwen), or scale it in fp32 and the product is rounded (Mixtral)."""
    sparse_layers: tuple[int, ...]
    """The layers whose feed-forward is the experts; the others have a dense MLP of the
    model's `intermediate_size` (Qwen's `mlp_only_layers` and `decoder_sparse_step`)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert, added to every token's output through a sigmoid gate (0:
    none)."""
    shared_expert_gated: bool = True
    """Whether the shared expert's output is scaled by sigmoid(`shared_expert_gate`) (Qwen2-MoE)
    or added as is (DeepSeek's `shared_experts`)."""
    checkpoint_names: str = "qwen"
    """How the checkpoint names the experts: "qwen" (`mlp.experts.E.gate_proj`), "mixtral"
    (`block_sparse_moe.experts.E.w1`) or "deepseek" (Qwen's, with `mlp.shared_experts.*` and
    V3's `mlp.gate.e_score_correction_bias`)."""
    scoring: str = "softmax"
    """How router logits become scores: "softmax" or "sigmoid" (DeepSeek-V3)."""
    topk_method: str = "greedy"
    """"greedy" (top k of all experts), "group_limited_greedy" (DeepSeek-V2: the top k of the
    `topk_groups` groups with the highest best score) or "noaux_tc" (DeepSeek-V3: groups ranked
    by the sum of their top-2 scores plus `e_score_correction_bias`, which steers the choice
    only, never the weights)."""
    num_groups: int = 1
    """Groups the experts are split into for the group-limited methods (HF's `n_group`)."""
    topk_groups: int = 1
    """Groups a token's experts may come from (HF's `topk_group`)."""
    routed_scaling_factor: float = 1.0
    """Multiplies every routing weight (DeepSeek), after any renormalisation."""

    @classmethod
    def from_hf_config(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig:
        layers = cfg["num_hidden_layers"]
        if arch == "MixtralForCausalLM":
            return cls(
                num_experts=cfg["num_local_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                intermediate_size=cfg["intermediate_size"],
                renormalize=True,
                weights_in_model_dtype=False,
                sparse_layers=tuple(range(layers)),
                checkpoint_names="mixtral",
            )
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or ())
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            weights_in_model_dtype=True,
            sparse_layers=tuple(
                i
                for i in range(layers)
                if i not in dense and num_experts > 0 and (i + 1) % step == 0
            ),
            shared_expert_intermediate_size=(
                cfg.get("shared_expert_intermediate_size", 0)
                if arch == "Qwen2MoeForCausalLM"
                else 0
            ),
        )

    @classmethod
    def deepseek(cls, arch: str, cfg: dict[str, Any]) -> MoEConfig:
        """DeepSeek-V2's or V3's experts, with HF transformers' semantics: refused where HF's
        classes and DeepSeek's own code would disagree (`moe_layer_freq` != 1, V2's
        `norm_topk_prob`, which HF's V2 router ignores)."""
        v3 = arch == _DEEPSEEK_V3
        num_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        if method not in allowed:
            raise ModelLoadError(f"{arch}: topk_method {method!r} is not supported; supported: "
                                 + ", ".join(allowed))  # fmt: skip
        if v3 and cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelLoadError(
                f"{arch}: scoring_func {cfg['scoring_func']!r}; supported: sigmoid"
            )
        if not v3 and cfg.get("norm_topk_prob"):
            raise ModelLoadError(
                f"{arch}: norm_topk_prob true is not supported (HF transformers' DeepseekV2 "
                "router ignores it, DeepSeek's own code renormalises: the two disagree)"
            )
        if (cfg.get("moe_layer_freq") or 1) != 1:
            raise ModelLoadError(
                f"{arch}: moe_layer_freq {cfg['moe_layer_freq']} is not supported; supported: 1 "
                "(HF transformers ignores it)"
            )
        groups = cfg.get("n_group") or 1
        topk_groups = cfg.get("topk_group") or groups
        if method != "greedy" and (num_experts % groups or not 0 < topk_groups <= groups):
            raise ModelLoadError(
                f"{arch}: n_group {groups} must divide n_routed_experts ({num_experts}) and "
                f"topk_group must be in [1, {groups}]; got {topk_groups}"
            )
        if v3 and num_experts // groups < 2:
            raise ModelLoadError(f"{arch}: noaux_tc needs at least 2 experts per group")
        first_sparse = cfg.get("first_k_dense_replace") or 0
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            renormalize=v3 and bool(cfg.get("norm_topk_prob", True)),
            weights_in_model_dtype=False,
            sparse_layers=tuple(range(first_sparse, cfg["num_hidden_layers"])),
            shared_expert_intermediate_size=(
                cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)
            ),
            shared_expert_gated=False,
            checkpoint_names="deepseek",
            scoring="sigmoid" if v3 else "softmax",
            topk_method=method,
            num_groups=groups,
            topk_groups=topk_groups,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling for a context `factor` (1 at factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. A token's keys and values come from one
    compressed entry, the paged cache's whole content per token and layer: the normalised
    latent (`kv_lora_rank`) and the rotary key part (`qk_rope_head_dim`) every head shares."""

    q_lora_rank: int | None
    """The query's low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj); None: q_proj."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    """Whether the rotary dims pair up as (x0, x1), (x2, x3), ... (V2 always; V3's
    `rope_interleave`), else as the two halves (rotate-half)."""
    softmax_scale: float
    """HF's: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times yarn's mscale(mscale_all_dim)
    squared under yarn."""
    rope_attention_factor: float = 1.0
    """What yarn multiplies cos and sin by (HF's `attention_factor`); 1 without yarn."""

    @property
    def entry_size(self) -> int:
        """Values the cache holds per token and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(
        cls, arch: str, cfg: dict[str, Any], rope_scaling: dict[str, Any] | None
    ) -> MLAConfig:
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        scale = (nope + rope) ** -0.5
        attention_factor = 1.0
        if rope_scaling is not None:  # yarn: `from_hf_config` refused every other kind
            factor = rope_scaling.get("factor")
            if factor is None:
                raise ModelLoadError(f"{arch}: rope_scaling yarn needs a factor")
            mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
            if mscale_all_dim:
                scale *= yarn_mscale(factor, mscale_all_dim) ** 2
            attention_factor = rope_scaling.get("attention_factor") or (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else yarn_mscale(factor)
            )
        return cls(
            q_lora_rank=cfg.get("q_lora_rank") or None,
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=arch != _DEEPSEEK_V3 or bool(cfg.get("rope_interleave", True)),
            softmax_scale=scale,
            rope_attention_factor=float(attention_factor),
        )


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    moe: MoEConfig | None = None
    """The experts of a mixture-of-experts model (None: dense)."""
    mla: MLAConfig | None = None
    """Multi-head latent attention (DeepSeek); then `num_key_value_heads` is 1 (the cache's one
    entry per token, shared by every head) and `head_dim` the rotary part's size."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    declared_pooling: str | None = None
    """How the model's sentence-transformers configuration pools token states for an
    embedding (engine/pooling_config.py), or None: it declares none."""
    embedding_only: bool = False
    """A base model's checkpoint (`BASE_MODELS`): no LM head (the embedding table stands in
    for it, so the one token an embedding request samples can be computed), and requests
    other than embeddings are refused. Its tensors may be named without the `model.` prefix."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        base = next((a for a in archs if a in BASE_MODELS), None) if arch is None else None
        if base is not None:
            arch = BASE_MODELS[base]
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<none>")
            known = [*SUPPORTED_ARCHITECTURES, *BASE_MODELS]
            raise ModelLoadError(
                f"unsupported architecture {name!r}; supported: {', '.join(known)}"
            )
        features = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            # transformers 5 moved theta under rope_parameters
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = rope_params.get("rope_theta", 10000.0)
            if rope_params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(rope_params)
        mla = features.get("mla", False)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            supported = ("yarn",) if mla else ("llama3", "linear")
            if kind == "default":
                rope_scaling = None
            elif kind not in supported:
                raise ModelLoadError(
                    f"rope_scaling type {kind!r} is not supported for {arch}; supported: "
                    + ", ".join(supported)
                )
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        max_pos = cfg.get("max_position_embeddings", 4096)
        if sliding is not None and sliding >= max_pos:
            sliding = None
        if sliding is not None:
            raise ModelLoadError(
                f"sliding_window={sliding} below max_position_embeddings={max_pos} is not supported"
            )
        moe: MoEConfig | None = None
        if mla and cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise ModelLoadError(
                f"{arch}: a {method}-quantized checkpoint (config.json's quantization_config, "
                "e.g. the Hub's FP8 DeepSeek-V3 weights) is not supported; use a bf16 conversion"
            )
        if mla:
            moe = MoEConfig.deepseek(arch, cfg)
        elif features.get("moe"):
            moe = MoEConfig.from_hf_config(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=1 if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=cfg["qk_rope_head_dim"] if mla else cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            # A base model has no head of its own: the embedding table stands in.
            tie_word_embeddings=base is not None or bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                # Qwen2-MoE's config names it qkv_bias (transformers 5), or not at all (always on)
                cfg.get(
                    "attention_bias", cfg.get("qkv_bias", features.get("attention_bias", False))
                )
            ),
            qk_norm=features.get("qk_norm", False),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe,
            mla=MLAConfig.from_hf_config(arch, cfg, rope_scaling) if mla else None,
            embedding_only=base is not None,
        )

    def ffn_sizes(self) -> tuple[int, ...]:
        """Every intermediate size a tensor-parallel rank takes a share of: the dense MLP's (where a
        layer has one), each routed expert's and the shared expert's."""
        moe = self.moe
        if moe is None:
            return (self.intermediate_size,)
        sizes = [moe.intermediate_size]
        if len(moe.sparse_layers) < self.num_hidden_layers:
            sizes.append(self.intermediate_size)
        if moe.shared_expert_intermediate_size:
            sizes.append(moe.shared_expert_intermediate_size)
        return tuple(sizes)
