"""Compile duet's Triton kernels for an H100 (sm_90) on a machine without a GPU, with the launch
configurations the wrappers pick, and print each kernel's resource use as JSON.

Run in its own process by tests/engine/test_triton_kernels.py: compiling needs `triton` imported
without TRITON_INTERPRET (the test process interprets). Triton's wheel ships ptxas and cuobjdump,
so this reaches real SASS: it catches what the lenient interpreter does not (tl.dot shape
minimums, operand types, constexpr use) and register spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.triton_cache import _write_kv_kernel
from engine.kernels.triton_decode import (
    _decode_kernel,
    _merge_kernel,
    decode_launch_config,
    merge_launch_config,
)
from engine.kernels.triton_prefill import _prefill_kernel, prefill_launch_config

CUDA = torch.device("cuda")  # only its type is read: nothing touches a device
TARGET = GPUTarget("cuda", 90, 32)
FP32_PTRS = {"part_out_ptr", "part_lse_ptr"}
INT_PTRS = {
    "slot_ptr": "*i64",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "decode_indices_ptr": "*i32",
    "prefill_indices_ptr": "*i32",
}
# Arguments a real launch sees as multiples of 16 at these shapes (Triton specialises on it).
NOT_DIVISIBLE = {"qk_scale", "stride_bt", "num_kv_heads"}


def compile_kernel(fn: Any, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    options = {k: config.pop(k) for k in ("num_warps", "num_stages") if k in config}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in config:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = INT_PTRS.get(name, "*fp32" if name in FP32_PTRS else dtype)
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name not in NOT_DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=config, attrs=attrs),
        target=TARGET,
        options=options,
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(
        item.split(":", 1) for line in usage.splitlines() if "REG:" in line for item in line.split()
    )
    return {
        "regs": int(fields["REG"]),
        "stack": int(fields["STACK"]),
        "local": int(fields["LOCAL"]),
    }


def main() -> None:
    results = {}
    bf16 = torch.bfloat16
    # Llama-3.1-8B: 32 query heads over 8 KV heads, head_dim 128; SmolLM2-135M: 9 over 3, 64.
    for model, group, head_dim in (("llama8b", 4, 128), ("smollm2", 3, 64)):
        write = {"BLOCK_H": 8 if model == "llama8b" else 4, "BLOCK_D": head_dim, "num_warps": 4}
        results[f"{model}/write_kv"] = compile_kernel(_write_kv_kernel, "*bf16", write)
        for splits in (1, 8):
            config = decode_launch_config(group, head_dim, splits, bf16, CUDA)
            results[f"{model}/decode_splits{splits}"] = compile_kernel(
                _decode_kernel, "*bf16", config
            )
        results[f"{model}/merge"] = compile_kernel(
            _merge_kernel, "*bf16", merge_launch_config(8, head_dim)
        )
        results[f"{model}/prefill"] = compile_kernel(
            _prefill_kernel, "*bf16", prefill_launch_config(group, head_dim, bf16, CUDA)
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
