"""Compile the quantized-linear Triton kernels (engine/quant/triton_linear.py) for an H100
(sm_90) on a machine without a GPU, with the launch configurations the wrappers pick at
Llama-3.1-8B's shapes for 1, 64 and 2,048 rows, and print each variant's resource use as JSON.
Run in its own process by tests/engine/test_quantized_triton.py (compiling needs `triton`
imported without TRITON_INTERPRET); see triton_sm90_compile.py."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from duet.engine.quant.triton_linear import (
    _dequantize_kernel,
    _split_k_sum_kernel,
    _wq_kernel,
    kernel_constexprs,
)
from duet.engine.quant.triton_linear import launch_config as choose
from tests.engine.triton_sm90_compile import compile_sm90

ACTIVATIONS = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
# format -> (int4, group size at K = 4096: None per channel)
FORMATS = {"w8a16/channel": (False, None), "w8a16/g32": (False, 32),
           "w4a16/g32": (True, 32), "w4a16/g128": (True, 128)}  # fmt: skip
ROWS = {"decode": 1, "batch64": 64, "batch128": 128}  # more: dequantize, then cuBLAS
N, K, SM_COUNT = 4096, 4096, 132
UNALIGNED = {"M", "num_groups"}  # a decode step's rows; K / group size is 1 per channel


def compile_kernel(fn: Any, ptrs: dict[str, str], constexprs: dict[str, Any]) -> dict[str, int]:
    return compile_sm90(
        fn,
        constexprs,
        lambda name: ptrs[name] if name.endswith("_ptr") else "i32",
        lambda name: name not in UNALIGNED,
    )


def main() -> None:
    results = {}
    for dtype, ptr in ACTIVATIONS.items():
        for fmt, (int4, group) in FORMATS.items():
            for rows_name, m in ROWS.items():
                cfg = choose(m, N, K, int4, getattr(torch, dtype), SM_COUNT)
                num_groups = 1 if group is None else K // group
                constexprs = kernel_constexprs(cfg, m, K, num_groups, int4, int4, ptr == "*fp32")
                out = ptr if cfg.split_k == 1 else "*fp32"
                weights = "*u8" if int4 else "*i8"
                ptrs = {"x_ptr": ptr, "q_ptr": weights, "scale_ptr": ptr, "zero_ptr": ptr,
                        "bias_ptr": ptr, "out_ptr": out}  # fmt: skip
                constexprs["HAS_BIAS"] = cfg.split_k == 1
                results[f"{dtype}/{fmt}/{rows_name}"] = {
                    **compile_kernel(_wq_kernel, ptrs, constexprs),
                    "config": [cfg.bm, cfg.bn, cfg.bk, cfg.split_k, cfg.num_warps, cfg.num_stages],
                }
            dequant = {"INT4": int4, "HAS_ZERO": int4, "GROUP": group or K, "BN": 32, "BK": 64,
                       "num_warps": 4}  # fmt: skip
            ptrs = {"q_ptr": "*u8" if int4 else "*i8", "scale_ptr": ptr, "zero_ptr": ptr,
                    "out_ptr": ptr}  # fmt: skip
            usage = compile_kernel(_dequantize_kernel, ptrs, dequant)
            results[f"{dtype}/{fmt}/dequantize"] = {**usage, "config": [32, 64]}
        for split in (2, 16):
            sums = {"SPLIT_K": split, "HAS_BIAS": True, "BLOCK": 1024, "num_warps": 4}
            ptrs = {"part_ptr": "*fp32", "bias_ptr": ptr, "out_ptr": ptr}
            usage = compile_kernel(_split_k_sum_kernel, ptrs, sums)
            results[f"{dtype}/split_k_sum/{split}"] = {**usage, "config": [split]}
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
