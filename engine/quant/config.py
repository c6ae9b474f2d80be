"""`QuantizationConfig`: which weights are quantized at load, and how (docs/quantization.md)."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.errors import InvalidInputError

QUANTIZATIONS = ("int8", "int4", "gguf")
"""int8: per output channel; int4: per group of columns; gguf: keep a GGUF file's own Q8_0,
Q4_0, Q4_1, Q4_K and Q6_K tensors quantized (repacked, not requantized)."""

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str
    """One of `QUANTIZATIONS`."""
    group_size: int = 32
    """int4: columns per scale (32, 64 or 128)."""
    symmetric: bool = False
    """int4: symmetric (scale only) instead of asymmetric (scale and offset) groups."""
    lm_head: bool = False
    """Quantize the LM head too (int8/int4: round to nearest; gguf: the file's own type)."""

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATIONS:
            raise InvalidInputError(
                "quantization", f"must be one of {', '.join(QUANTIZATIONS)}; got {self.method!r}"
            )
        if self.group_size not in INT4_GROUP_SIZES:
            raise InvalidInputError(
                "quantization_group_size",
                f"must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; got {self.group_size!r}",
            )

    def describe(self) -> str:
        if self.method == "int4":
            kind = "symmetric" if self.symmetric else "asymmetric"
            return f"int4 ({kind}, groups of {self.group_size})"
        if self.method == "int8":
            return "int8 (per output channel)"
        return "gguf (the file's quantized tensors, repacked)"
