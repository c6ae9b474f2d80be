"""Compile every Triton kernel variant duet ships for an H100 (sm_90) on a machine without a GPU,
with the launch configurations the wrappers pick, and print each one's resource use as JSON.

Run in its own process by tests/engine/test_triton_kernels.py: compiling needs `triton` imported
without TRITON_INTERPRET (the test process interprets). Triton's wheel ships ptxas, so this
reaches real SASS: it catches what the lenient interpreter does not (tl.dot shape minimums,
operand types, constexpr use) and register spills, which ptxas reports.

A variant is a (model shape, dtype, kernel): the decode kernel's split count is a runtime
argument (triton_decode), so one variant serves every split count from 1 to MAX_SPLITS.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from duet.engine.kernels.triton_cache import _write_kv_kernel
from duet.engine.kernels.triton_decode import (
    _decode_kernel,
    _merge_kernel,
    decode_launch_config,
    merge_launch_config,
)
from duet.engine.kernels.triton_elementwise import (
    SILU_BLOCK,
    _add_rms_norm_kernel,
    _rotary_kernel,
    _rotary_store_kernel,
    _silu_and_mul_kernel,
)
from duet.engine.kernels.triton_matmul import _matmul_kernel, matmul_config
from duet.engine.kernels.triton_mla import _mla_kernel, mla_launch_config
from duet.engine.kernels.triton_norm import _rms_norm_kernel
from duet.engine.kernels.triton_prefill import _fold_kernel, _prefill_kernel, prefill_launch_config

CUDA = torch.device("cuda")  # only its type is read: nothing touches a device
TARGET = GPUTarget("cuda", 90, 32)
# The dtypes EngineConfig accepts, with Triton's pointer type for the cache and activations.
DTYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
# Llama-3.1-8B: 32 query heads over 8 KV heads, head_dim 128; SmolLM2-135M: 9 over 3, 64.
MODELS = {"llama8b": (8, 4, 128), "smollm2": (3, 3, 64)}
# The rotary embedding's tables are fp32 whatever the model's dtype.
HIDDEN = {"llama8b": 4096, "smollm2": 576}
FP32_PTRS = {"part_out_ptr", "part_lse_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr",
             "cos_ptr", "sin_ptr"}  # fmt: skip
INT_PTRS = {
    "slot_ptr": "*i64",
    "query_start_loc_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "decode_indices_ptr": "*i32",
    "prefill_indices_ptr": "*i32",
    "pos_ptr": "*i64",
}
# Arguments a real launch sees as multiples of 16 at these shapes (Triton specialises on it).
NOT_DIVISIBLE = {"qk_scale", "num_kv_heads", "eps", "M", "num_q_heads", "num_k_heads"}


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers, spill bytes and stack frame of the one kernel in `ptx`, as ptxas reports them."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        log = subprocess.run(
            [get_ptxas(TARGET.arch).path, "-v", "--gpu-name=sm_90a", src.name, "-o", "/dev/null"],
            capture_output=True, text=True, check=True, timeout=120,
        ).stderr  # fmt: skip

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        if found is None:
            raise RuntimeError(f"ptxas -v printed no {pattern!r}:\n{log}")
        return int(found.group(1))

    return {
        "regs": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "stack": number(r"(\d+) bytes stack frame"),
    }


def compile_sm90(
    fn: Any,
    constexprs: dict[str, Any],
    arg_type: Callable[[str], str],
    divisible: Callable[[str], bool],
) -> dict[str, int]:
    """Compile `fn` for sm_90 as a launch with `constexprs` (and `num_warps`, `num_stages`)
    would, each other argument typed by `arg_type` and marked a multiple of 16 where
    `divisible` says a real launch passes one (Triton specialises on it); its resource use."""
    constexprs = dict(constexprs)
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = arg_type(name)
        if divisible(name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=TARGET,
        options=options,
    )
    return {**ptxas_usage(kernel.asm["ptx"]), "shared_bytes": kernel.metadata.shared}


def compile_kernel(fn: Any, dtype: str, config: dict[str, Any]) -> dict[str, int]:
    """Compile an attention or norm kernel `fn` as a launch with `config` would, for sm_90."""
    unspecialised = set(fn.do_not_specialize)
    unaligned = set(fn.do_not_specialize_on_alignment)

    def arg_type(name: str) -> str:
        if name.endswith("_ptr"):
            return INT_PTRS.get(name, "*fp32" if name in FP32_PTRS else dtype)
        return "fp32" if name in ("qk_scale", "eps") else "i32"

    def divisible(name: str) -> bool:
        if name.endswith("_ptr"):
            return name not in unaligned
        return name not in NOT_DIVISIBLE and name not in unspecialised

    return compile_sm90(fn, config, arg_type, divisible)


def shipped_variants() -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """Every (kernel, pointer type, launch config) the wrappers launch for these models."""
    variants = {}
    for model, (kv_heads, group, head_dim) in MODELS.items():
        for dtype_name, ptr in DTYPES.items():
            dtype = getattr(torch, dtype_name)
            name = f"{model}/{dtype_name}"
            write = {"BLOCK_H": triton.next_power_of_2(kv_heads), "BLOCK_D": head_dim}
            variants[f"{name}/write_kv"] = (_write_kv_kernel, ptr, {**write, "num_warps": 4})
            decode = decode_launch_config(group, head_dim, dtype, CUDA)
            variants[f"{name}/decode"] = (_decode_kernel, ptr, decode)
            merge = merge_launch_config(head_dim, decode["BLOCK_N"])
            variants[f"{name}/merge"] = (_merge_kernel, ptr, merge)
            prefill = prefill_launch_config(group, head_dim, dtype, CUDA)
            variants[f"{name}/prefill"] = (_prefill_kernel, ptr, {**prefill, "SPLIT": False})
            # deterministic decode: the prefill kernel by partition, then the left fold
            split = {**prefill, "SPLIT": True}
            variants[f"{name}/prefill_split"] = (_prefill_kernel, ptr, split)
            fold = {"BLOCK_D": prefill["BLOCK_D"], "PARTITION": prefill["PARTITION"]}
            variants[f"{name}/fold"] = (_fold_kernel, ptr, {**fold, "num_warps": 4})
            # deterministic inference: the batch-invariant linears and norms
            for bias in (False, True):
                gemm = {**matmul_config(dtype, CUDA), "HAS_BIAS": bias}
                variants[f"{name}/matmul{'_bias' if bias else ''}"] = (_matmul_kernel, ptr, gemm)
            block = triton.next_power_of_2(HIDDEN[model])
            norm = {"BLOCK": block, "num_warps": min(16, max(1, block // 256))}
            variants[f"{name}/rms_norm"] = (_rms_norm_kernel, ptr, norm)
            # every dtype's decoder-layer operators (triton_elementwise.py)
            variants[f"{name}/add_rms_norm"] = (_add_rms_norm_kernel, ptr, norm)
            heads = kv_heads * group
            rotary = {"BLOCK_D": head_dim // 2, "BLOCK_H": triton.next_power_of_2(heads),
                      "num_warps": 4}  # fmt: skip
            variants[f"{name}/rotary"] = (_rotary_kernel, ptr, rotary)
            variants[f"{name}/rotary_store"] = (_rotary_store_kernel, ptr, rotary)
            silu = {"BLOCK": SILU_BLOCK, "num_warps": 4}
            variants[f"{name}/silu_and_mul"] = (_silu_and_mul_kernel, ptr, silu)
    for dtype_name, ptr in DTYPES.items():  # DeepSeek-V2/V3's latent attention: 512 + 64
        mla = mla_launch_config(512, 64, getattr(torch, dtype_name), CUDA)
        variants[f"deepseek_v3/{dtype_name}/mla"] = (_mla_kernel, ptr, mla)
        # the latent cache's one plane (576 values a token), a CUDA graph's padding skipped
        plane = {"BLOCK_H": 1, "BLOCK_D": 1024, "WRITE_VALUE": False, "num_warps": 4}
        variants[f"deepseek_v3/{dtype_name}/write_latent"] = (_write_kv_kernel, ptr, plane)
    return variants


def main() -> None:
    results = {
        name: compile_kernel(fn, ptr, config)
        for name, (fn, ptr, config) in shipped_variants().items()
    }
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
