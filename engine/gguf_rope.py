"""HF's `rope_scaling` from a GGUF file's `{arch}.rope.scaling.*` metadata (engine/gguf_loader.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duet.engine.errors import ModelLoadError


def gguf_rope_scaling(architecture: str, field: Callable[..., Any]) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (or the older `rope.scale_linear`)."""
    scaling_type = field("rope.scaling.type")
    factor = field("rope.scaling.factor")
    if scaling_type is None and field("rope.scale_linear") is not None:
        scaling_type, factor = "linear", field("rope.scale_linear")
    if scaling_type in (None, "none") or (scaling_type == "linear" and factor == 1.0):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ModelLoadError(
            f"{architecture}.rope.scaling.type: {scaling_type!r} is not supported; "
            "supported: none, linear, yarn"
        )
    if factor is None:
        raise ModelLoadError(f"{architecture}.rope.scaling.factor: missing for {scaling_type}")
    rope_scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": float(factor)}
    if scaling_type == "yarn":
        optional = {
            "original_max_position_embeddings": ("rope.scaling.original_context_length", int),
            "attention_factor": ("rope.scaling.attn_factor", float),
            "beta_fast": ("rope.scaling.yarn_beta_fast", float),
            "beta_slow": ("rope.scaling.yarn_beta_slow", float),
        }
        for hf_key, (gguf_key, cast) in optional.items():
            value = field(gguf_key)
            if value is not None:
                rope_scaling[hf_key] = cast(value)
    return rope_scaling
