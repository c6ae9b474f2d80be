"""Compile the fused MoE Triton kernel (engine/kernels/triton_moe.py) for an H100 (sm_90) on a
machine without a GPU, in every variant `fused_experts` launches (gate|up with gathered token
rows; down with the routing weights in fp32 or in the model's dtype) for each dtype, and print
each one's resource use as JSON. Run in its own process by tests/engine/test_triton_moe.py
(compiling needs `triton` imported without TRITON_INTERPRET); see triton_sm90_compile.py."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from duet.engine.kernels.triton_moe import _expert_matmul_kernel, moe_config
from tests.engine.triton_sm90_compile import compile_sm90

DTYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
INT_PTRS = {"sorted_slots_ptr": "*i32", "block_expert_ptr": "*i32", "scale_ptr": "*fp32"}
UNALIGNED = {"num_slots"}  # a step's token count times k
VARIANTS = {  # name -> (GATHER, SCALE, SCALE_IN_MODEL_DTYPE)
    "gate_up": (True, False, False),
    "down_fp32_weights": (False, True, False),
    "down_model_dtype_weights": (False, True, True),
}


def compile_kernel(ptr: str, constexprs: dict[str, Any]) -> dict[str, int]:
    return compile_sm90(
        _expert_matmul_kernel,
        constexprs,
        lambda name: INT_PTRS.get(name, ptr) if name.endswith("_ptr") else "i32",
        lambda name: name not in UNALIGNED,
    )


def main() -> None:
    results = {}
    for dtype, ptr in DTYPES.items():
        config = moe_config(getattr(torch, dtype), torch.device("cuda"))
        for name, (gather, scale, in_model) in VARIANTS.items():
            for top_k in (1, 2, 8):  # the exchange's rows (expert_rows), Mixtral's, Qwen3-MoE's
                constexprs = {**config, "TOP_K": top_k, "GATHER": gather, "SCALE": scale,
                              "SCALE_IN_MODEL_DTYPE": in_model}  # fmt: skip
                results[f"{dtype}/{name}/top{top_k}"] = compile_kernel(ptr, constexprs)
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
