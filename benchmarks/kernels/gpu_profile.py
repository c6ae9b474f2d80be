"""Where a decode step's time goes: `python -m benchmarks.kernels.gpu --profile` runs duet's
decode step (eager, and as the CUDA-graph replay the engine runs) under the torch profiler and
splits the device time among kinds of kernels: the weight products (cuBLAS/CUTLASS GEMMs,
duet's Triton matmul), attention (duet's Triton paged decode and its merge), the KV write,
norms, rotary embedding, the MLP activation, sampling and logits, copies and other elementwise
kernels, collectives (tensor parallelism), and the rest. Beside each kind: its share of the step, and for the weight products
the time the weight bytes would take at the bandwidth measured in the same run (how close
the GEMMs themselves are to the roofline). What the kernels do not cover (the step's time
less the kernels' sum) is launch gaps and host work the graph did not remove.

Kernels launched by a CUDA-graph replay are reported by CUPTI like any other; should a
profiler version not see them, the graph rows say so (`kernels_seen` 0) rather than report an
empty step. On the CPU (`--smoke`) the same code profiles the CPU operators, which checks the
script only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# kind -> substrings of the kernel (or CPU operator) name, matched in this order, lower case
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_decode_kernel", "_merge_kernel", "_prefill_kernel", "_fold_kernel",
                   "attention", "flash", "sdpa")),
    ("kv_write", ("_write_kv_kernel", "write_kv", "index_copy")),
    ("norm", ("rms_norm", "_norm_kernel", "layer_norm", "rsqrt")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "_matmul_kernel", "_expert_matmul", "cublas",
              "splitk", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
              "dense_linear")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "act_and_mul", "gelu", "sigmoid")),
    ("communication", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "log_softmax", "cumsum")),
    ("copy_elementwise", ("elementwise", "copy", "cat", "index", "fill", "reduce", "mul", "add",
                          "where", "to_copy", "clone", "embedding", "gather", "scatter")),
)  # fmt: skip


def kind_of(name: str) -> str:
    """The kind of a kernel or operator by its name (KINDS); "other" when none matches."""
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def _device_us(event: Any, on_cuda: bool) -> float:
    """An averaged event's own time on the device (CUDA) or the CPU (smoke), microseconds."""
    if not on_cuda:
        return float(event.self_cpu_time_total)
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(
    step: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2
) -> dict[str, Any]:
    """Run `step` `iters` times under the profiler; per step: the kernels' device time by kind
    (ms), the number of kernels, and the ten costliest kernels. On the CPU: operators' own CPU
    time instead of kernels (leaf operators only, so nothing counts twice)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if on_cuda:
        torch.cuda.synchronize()
    # On CUDA the CPU activity too: kernels are reported beside the operators that launched
    # them (CUDA alone has left them out in some torch versions); only device events count.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        if on_cuda:
            torch.cuda.synchronize()
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KINDS}
    by_kind["other"] = 0.0
    kernels: list[tuple[str, float, int]] = []
    count = 0
    for event in prof.key_averages():
        if on_cuda and getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = _device_us(event, on_cuda)
        if us <= 0.0:
            continue
        by_kind[kind_of(event.key)] += us
        kernels.append((event.key, us, int(event.count)))
        count += int(event.count)
    kernels.sort(key=lambda k: -k[1])
    per_step = 1e-3 / iters  # microseconds over `iters` steps -> milliseconds per step
    return {
        "kernels_seen": count // iters,
        "kernel_ms": sum(by_kind.values()) * per_step,
        "by_kind_ms": {kind: us * per_step for kind, us in by_kind.items()},
        "top": [
            {"name": name[:120], "ms": us * per_step, "calls": calls // iters}
            for name, us, calls in kernels[:10]
        ],
    }


def summarise(
    prof: dict[str, Any], step_ms: float, weight_bytes: int, bandwidth_gbs: float
) -> dict[str, Any]:
    """Add to a `profile_step` result the step's time, what the kernels leave uncovered, each
    kind's share of the step, and the weight products' time against their bytes' roofline."""
    gemm_ms = prof["by_kind_ms"]["gemm"]
    weights_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3
    return {
        **prof,
        "step_ms": step_ms,
        "uncovered_ms": step_ms - prof["kernel_ms"],
        "share": {k: v / step_ms for k, v in prof["by_kind_ms"].items()} if step_ms else {},
        "weights_roofline_ms": weights_ms,
        "gemm_of_roofline": weights_ms / gemm_ms if gemm_ms else None,
    }


def print_profile(name: str, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        for mode in ("eager", "graph"):
            p = row.get(mode)
            if p is None:
                continue
            kinds = "  ".join(f"{k} {v:.2f}" for k, v in p["by_kind_ms"].items() if v > 0)
            gemm = p["gemm_of_roofline"]
            print(f"{name} batch {row['batch']} {mode}: step {p['step_ms']:.2f} ms, kernels "
                  f"{p['kernel_ms']:.2f} ms ({p['kernels_seen']} per step), uncovered "
                  f"{p['uncovered_ms']:.2f} ms; GEMMs at "
                  f"{'-' if gemm is None else f'{gemm:.0%}'} of their weights' roofline")  # fmt: skip
            print(f"  ms by kind: {kinds}")
