"""`ModelArchConfig`: the shape of a Llama-family model, read from an HF config.json dict."""

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
}


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
            attention_bias=bool(cfg.get("attention_bias", features.get("attention_bias", False))),
            qk_norm=features.get("qk_norm", False),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
