"""Microbenchmark of the CPU products a quantized linear can run, at decode shapes, in one run
(ratios within a run are what to read on a shared machine):

    nice python -m benchmarks.quantized.kernels [--rows 1,4,16,32,64] [--threads N]

Per SmolLM2 projection shape (N x K) and row count: dense bf16 (oneDNN packed, and duet's own
dense kernel, what a bf16 model runs and the ratios' base when it builds), duet's int8 kernel (engine/kernels/quant_linear_cpu.cpp: fp32 FMAs, and vdpbf16ps on
AVX512-BF16, AMX tiles where the CPU has AMX; per channel and in groups of 32 as GGUF Q8_0; int4
in groups of 32), torch's `_weight_int8pack_mm`, torch's int4 kernel (groups of 32), and
dequantize-then-multiply. The fastest of `--repeat` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from duet.engine.model.dense_cpu_linear import load_dense_kernel
from duet.engine.quant.cpu_linear import int4_linear, int8_linear, load_quant_kernels, pack_int8
from duet.engine.quant.cpu_linear import pack_int4 as pack_int4_pairs
from duet.engine.quant.formats import pack_int4, quantize_int4, quantize_int8

NO_AMX = 1 << 62
"""amx_min_rows that keeps a call on the bf16 dot."""

SHAPES = [(576, 576), (1536, 576), (576, 1536), (192, 576), (960, 576), (3072, 576), (49152, 576)]
"""(N, K): o, gate|up halves, down, k|v, q|k|v, gate|up, the tied LM head."""


def _time(fn: Callable[[], object], repeat: int, clock: Callable[[], float]) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times) * 1e6


def products(n: int, k: int, rows: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    kernels = load_quant_kernels()
    q8 = quantize_int8(w)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16))
    bf16_scale = q8.scale.squeeze(1).to(torch.bfloat16)
    q4 = quantize_int4(w, 32, symmetric=False)
    pad = -n % 64
    q4q = torch.cat([q4.q, q4.q.new_full((pad, k), 8)]) if pad else q4.q
    sz = torch.stack([q4.scale, q4.offset + 8 * q4.scale], -1)  # type: ignore[operator]
    sz = torch.cat([sz, sz.new_zeros(pad, *sz.shape[1:])]) if pad else sz
    p4, sz4 = pack_int4(q4q), sz.transpose(0, 1).contiguous().to(torch.bfloat16)
    q8g = quantize_int8(w, 32)
    g_q, g_scale = q8g.q, q8g.scale
    out: dict[str, Callable[[], object]] = {
        "bf16 oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "torch int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q8.q, bf16_scale),
        "torch int4 g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, 32, sz4),
        "dequant+linear": lambda: F.linear(x, (q8.q.float() * q8.scale).to(torch.bfloat16)),
    }
    dense = load_dense_kernel()
    if dense is not None:  # what a bf16 model runs on the CPU (the ratios' base when built)
        panels = dense.pack_dense(w.to(torch.bfloat16))
        out["bf16 duet"] = lambda: dense.dense_linear_packed(x, panels, n, None)
    if kernels is not None:
        pc, sc = pack_int8(q8.q, q8.scale)
        pg, sg = pack_int8(g_q, g_scale)
        out["duet int8 fma"] = lambda: int8_linear(kernels, x, pc, sc, n)
        if kernels.bf16_dot():
            pd, sd = pack_int8(q8.q, q8.scale, pairs=True)
            pgd, sgd = pack_int8(g_q, g_scale, pairs=True)
            out["duet int8 dot"] = lambda: int8_linear(kernels, x, pd, sd, n, NO_AMX)
            out["duet int8 g32 dot"] = lambda: int8_linear(kernels, x, pgd, sgd, n, NO_AMX)
            nib, sz = pack_int4_pairs(q4.q, q4.scale, q4.offset)
            out["duet int4 g32 dot"] = lambda: int4_linear(kernels, x, nib, sz, n, True, NO_AMX)
            if kernels.amx():  # the same operands through AMX tiles
                out["duet int8 amx"] = lambda: int8_linear(kernels, x, pd, sd, n, 1)
                out["duet int8 g32 amx"] = lambda: int8_linear(kernels, x, pgd, sgd, n, 1)
                out["duet int4 g32 amx"] = lambda: int4_linear(kernels, x, nib, sz, n, True, 1)
        else:
            out["duet int8 g32 fma"] = lambda: int8_linear(kernels, x, pg, sg, n)
        nf, szf = pack_int4_pairs(q4.q, q4.scale, q4.offset, pairs=False)
        out["duet int4 g32 fma"] = lambda: int4_linear(kernels, x, nf, szf, n, False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32,64")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="1 (default): timed in the thread's CPU time, which other processes on a shared "
        "machine do not inflate; more: wall-clock time",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--shapes", default=None, help="NxK,NxK (default: SmolLM2's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]  # type: ignore[misc]
    kind = "thread CPU" if args.threads == 1 else "wall-clock"
    print(f"threads {args.threads}; fastest of {args.repeat} calls, us of {kind} time")
    for n, k in shapes:
        for rows in (int(r) for r in args.rows.split(",")):
            fns = products(n, k, rows)
            times = {name: _time(fn, args.repeat, clock) for name, fn in fns.items()}
            base = times.get("bf16 duet", times["bf16 oneDNN"])
            cells = "  ".join(f"{name} {t:8.1f} ({t / base:4.2f}x)" for name, t in times.items())
            print(f"{n:6d}x{k:<5d} rows {rows:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
