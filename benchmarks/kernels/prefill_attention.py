"""CPU prefill attention: duet's C++ kernel (engine/kernels/paged_prefill_cpu.cpp) against
torch's SDPA flash kernel, the path it replaced, on one prompt of each length.

    python -m benchmarks.kernels.prefill_attention                       # SmolLM2's heads, fp32 + bf16
    python -m benchmarks.kernels.prefill_attention --heads 32 --kv-heads 8 --head-dim 128 --lengths 512

duet reads K/V from a paged cache with scattered blocks; SDPA gets the same K/V contiguous
(`[1, heads, len, D]`, `is_causal=True`, `enable_gqa=True`), as attention.py used to pass them.
Both outputs are compared before timing. Reported: median ms of each, GFLOP/s counting the
causal half only (2 * len^2 * heads * head_dim), and SDPA time / duet time. Results: a table on
stdout and benchmarks/results/prefill_attention.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common.machine import cpu_info, git_commit

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "benchmarks/results/prefill_attention.json"


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def measure(
    kernels: Any,
    length: int,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    reps: int,
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(length)
    num_blocks = -(-length // block_size)
    pool = num_blocks + 8
    key_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(pool, generator=g)[:num_blocks]
    query = torch.randn(length, heads, head_dim, generator=g).to(dtype)
    keys = key_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    values = value_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    scale = head_dim**-0.5
    q4, k4, v4 = (x.transpose(0, 1)[None].contiguous() for x in (query, keys, values))
    out = torch.empty_like(query)
    lens = torch.tensor([length])

    def duet() -> None:
        kernels.paged_prefill_attention(
            out, query, key_cache, value_cache, table[None], lens, torch.tensor([0]), lens, scale
        )

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=heads != kv_heads
        )

    duet()
    want = sdpa()[0].transpose(0, 1).float()
    max_err = float((out.float() - want).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if max_err > tol:
        raise RuntimeError(f"duet and SDPA differ by {max_err} at {length} tokens ({dtype})")
    duet_ms, sdpa_ms = median_ms(duet, reps), median_ms(sdpa, reps)
    flops = 2 * length * length * heads * head_dim  # QK^T and PV over the causal half
    return {
        "length": length,
        "dtype": str(dtype).removeprefix("torch."),
        "duet_ms": duet_ms,
        "sdpa_ms": sdpa_ms,
        "duet_gflops": flops / duet_ms / 1e6,
        "sdpa_gflops": flops / sdpa_ms / 1e6,
        "ratio": sdpa_ms / duet_ms,
        "max_abs_diff": max_err,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 512, 1024]
    )
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    from duet.engine.cpu_runtime import configure_cpu_runtime
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.prefill_head_dim_supported(args.head_dim):
        raise SystemExit(f"duet's prefill kernel cannot run here for head_dim {args.head_dim}")
    torch.set_num_threads(args.threads)
    configure_cpu_runtime()  # as the engine runs: denormals flushed, freed memory kept
    rows = []
    print(
        f"{'dtype':<9} {'tokens':>6} {'duet ms':>8} {'SDPA ms':>8} {'duet GFLOP/s':>13} "
        f"{'SDPA GFLOP/s':>13} {'SDPA/duet':>9}"
    )
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for length in args.lengths:
            r = measure(
                kernels,
                length,
                dtype,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
                args.reps,
            )
            rows.append(r)
            print(
                f"{name:<9} {length:>6} {r['duet_ms']:>8.3f} {r['sdpa_ms']:>8.3f} "
                f"{r['duet_gflops']:>13.0f} {r['sdpa_gflops']:>13.0f} {r['ratio']:>8.2f}x"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "prefill_attention",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": {**cpu_info(), "threads": args.threads, "torch": torch.__version__},
                "git": git_commit(),
                "shape": {
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "block_size": args.block_size,
                },
                "results": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
