"""The weight formats a quantized benchmark compares, as `LLM` / `load_model` arguments."""

from __future__ import annotations

from typing import Any

METHODS = ("bf16", "int8", "int4", "gguf")
"""bf16: full-precision weights; int8/int4: rounded to nearest at load; gguf: a GGUF file's own
quantized tensors (the embedded SmolLM2 is Q4_1), repacked."""
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
"""Activation dtypes, and the label of the full-precision row in each."""


def label(method: str, dtype: str) -> str:
    """The system's name in results: `duet-int4`, and `duet-bf16` / `duet-fp32` for the
    full-precision weights."""
    return f"duet-{DTYPES[dtype] if method == 'bf16' else method}"


def engine_kwargs(
    method: str, group_size: int, lm_head: bool = False, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """`EngineConfig` fields of `method`, activations in `dtype` (bf16; float32 on CPUs
    without native bf16, where it is the default); `lm_head`: quantize the LM head too (a tied
    head gets a quantized copy, as llama.cpp's Q8_0/Q4_1 files quantize theirs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    kwargs: dict[str, Any] = {"dtype": dtype}
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
