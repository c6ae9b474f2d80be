"""duet's dense CPU linear against oneDNN's packed linear (what vLLM's CPU backend and duet's
non-deterministic path run; torch's F.linear where torch cannot pack the dtype), per call, at
SmolLM2's layer shapes.

    python -m benchmarks.kernels.dense_linear [--dtype bfloat16] [--rows 1,16,64,256,2048]

For each of SmolLM2-135M's dense products (q|k|v [960, 576], o [576, 576], gate|up [3072, 576],
down [576, 1536]) and each row count, the two products alternate over `--rounds` rounds and the
best ms per call of each is reported with their ratio (duet / oneDNN: below 1 is faster). duet's
kernel is the batch-invariant one deterministic mode uses (bf16: AMX tiles where the CPU has
them, AVX512-BF16's dot without AMX, else FMA panels; fp32: FMA panels). The hardware limit (2 x M x N x K at the measured time)
is printed as achieved GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common.timing import ms_per_call

SHAPES = {  # name: (N, K), SmolLM2-135M
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--rows", default="1,16,64,256,2048", help="comma list of row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from duet.engine.model.dense_cpu_linear import load_dense_kernel
    from duet.engine.model.packed_linear import packing_supported

    dtype = getattr(torch, args.dtype)
    kernel = load_dense_kernel()
    if kernel is None:
        sys.exit("duet's dense CPU kernel did not build (or DUET_CPU_KERNELS=0)")
    # The baseline: oneDNN's packed linear, or torch's F.linear (MKL) where torch has no
    # packed linear for the dtype (fp32 on most builds).
    packed = packing_supported(dtype)
    baseline = "oneDNN packed" if packed else "torch F.linear"
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    form = "FMA panels"
    if dtype == torch.bfloat16 and kernel.amx():
        form = "AMX tiles"
    elif dtype == torch.bfloat16 and kernel.bf16_dot():
        form = "AVX512-BF16 dot"
    print(f"{args.dtype}, {args.threads} threads, duet's kernel in {form}, baseline {baseline}")
    g = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
        panels = kernel.pack_dense(w)
        onednn = torch.ops.mkldnn._reorder_linear_weight(w) if packed else w
        for m in rows_list:
            x = torch.randn(m, k, generator=g).to(dtype)
            reps = max(5, min(2000, int(2e8 / (m * n * k))))
            calls = {
                "duet": partial(kernel.dense_linear_packed, x, panels, n, None),
                "onednn": (
                    partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], "")
                    if packed
                    else partial(F.linear, x, w)
                ),
            }
            times: dict[str, list[float]] = {"duet": [], "onednn": []}
            for r in range(args.rounds):
                for which in ("duet", "onednn") if r % 2 == 0 else ("onednn", "duet"):
                    times[which].append(ms_per_call(calls[which], reps))
            duet, ref = min(times["duet"]), min(times["onednn"])
            gflops = 2 * m * n * k / (duet * 1e-3) / 1e9
            results.append({"layer": name, "n": n, "k": k, "rows": m, "duet_ms": duet,
                            "baseline_ms": ref, "duet_over_baseline": duet / ref,
                            "duet_gflops": gflops})  # fmt: skip
            print(f"{name:8s} [{n}x{k}] rows {m:5d}: duet {duet:8.4f} ms ({gflops:7.1f} GFLOP/s), "
                  f"{baseline} {ref:8.4f} ms, ratio {duet / ref:.2f}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"dtype": args.dtype, "threads": args.threads,
                                        "duet_form": form, "baseline": baseline, "results": results}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
