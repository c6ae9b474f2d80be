"""The weight formats a quantized benchmark compares, as `LLM` / `load_model` arguments."""

from __future__ import annotations

from typing import Any

METHODS = ("bf16", "int8", "int4", "gguf")
"""bf16: full-precision weights; int8/int4: rounded to nearest at load; gguf: a GGUF file's own
quantized tensors (the embedded SmolLM2 is Q4_1), repacked."""


def engine_kwargs(method: str, group_size: int, lm_head: bool = False) -> dict[str, Any]:
    """`EngineConfig` fields of `method` (all in bf16); `lm_head`: quantize the LM head too (a
    tied head gets a quantized copy, as llama.cpp's Q8_0/Q4_1 files quantize theirs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    kwargs: dict[str, Any] = {"dtype": "bfloat16"}
    if method != "bf16":
        kwargs["quantization"] = method
    if method != "bf16" and lm_head:
        kwargs["quantize_lm_head"] = True
    if method == "int4":
        kwargs["quantization_group_size"] = group_size
    return kwargs


def applicable(method: str, model: str | None) -> bool:
    """gguf needs a GGUF file (None is the embedded one)."""
    return method != "gguf" or model is None or model.endswith(".gguf")
