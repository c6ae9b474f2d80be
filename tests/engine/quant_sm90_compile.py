"""Compile the quantized-linear Triton kernels (engine/quant/triton_linear.py) for an H100
(sm_90) on a machine without a GPU, at the block sizes the wrappers launch, and print each
variant's resource use as JSON. Run in its own process by tests/engine/test_quantized_triton.py
(compiling needs `triton` imported without TRITON_INTERPRET); see triton_sm90_compile.py."""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.compiler import ASTSource

from engine.quant.triton_linear import BLOCK_K, BLOCK_M, BLOCK_N, _w4a16_kernel, _w8a16_kernel
from tests.engine.triton_sm90_compile import TARGET, ptxas_usage

ACTIVATIONS = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
WEIGHTS = {"q_ptr": {_w8a16_kernel: "*i8", _w4a16_kernel: "*u8"}}
UNALIGNED = {"M", "num_groups"}  # a decode step's rows; K / group size


def compile_variant(fn: Any, ptr: str, group: int) -> dict[str, int]:
    precision = "ieee" if ptr == "*fp32" else "tf32"  # as triton_linear._precision
    constexprs = {
        "GROUP": group,
        "BM": BLOCK_M,
        "BN": BLOCK_N,
        "BK": BLOCK_K,
        "PRECISION": precision,
    }
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = WEIGHTS.get(name, {}).get(fn, ptr)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name not in UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET
    )
    return {**ptxas_usage(kernel.asm["ptx"]), "shared_bytes": kernel.metadata.shared}


def main() -> None:
    results = {}
    for dtype, ptr in ACTIVATIONS.items():
        for name, fn, group in (("w8a16/g32", _w8a16_kernel, 32), ("w8a16/channel", _w8a16_kernel, 576),
                                ("w4a16/g32", _w4a16_kernel, 32), ("w4a16/g128", _w4a16_kernel, 128)):  # fmt: skip
            results[f"{dtype}/{name}"] = compile_variant(fn, ptr, group)
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
