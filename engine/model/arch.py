"""`ModelArchConfig`: the shape of a Llama-family model, read from an HF config.json dict, with
`MoEConfig` for the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

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
}


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
    checkpoint_names: str = "qwen"
    """How the checkpoint names the experts: "qwen" (`mlp.experts.E.gate_proj`) or "mixtral"
    (`block_sparse_moe.experts.E.w1`)."""

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

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<none>")
            raise ModelLoadError(
                f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
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
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind == "default":
                rope_scaling = None
            elif kind not in ("llama3", "linear"):
                raise ModelLoadError(
                    f"rope_scaling type {kind!r} is not supported; supported: llama3, linear"
                )
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        max_pos = cfg.get("max_position_embeddings", 4096)
        if sliding is not None and sliding >= max_pos:
            sliding = None
        if sliding is not None:
            raise ModelLoadError(
                f"sliding_window={sliding} below max_position_embeddings={max_pos} is not supported"
            )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
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
            moe=MoEConfig.from_hf_config(arch, cfg) if features.get("moe") else None,
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
