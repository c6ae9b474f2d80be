"""A single-stream decode step's attention on the CPU: `decode_attention_step` (rotary, KV write
and paged attention in one call) once for each of 30 layers, each layer its own cache, against
one thread and against the machine's read rate.

    python -m benchmarks.kernels.decode_step_attention

SmolLM2's heads (9 query, 3 KV, head_dim 64), 16-token blocks scattered in the cache, bf16, one
sequence of 64-512 tokens. Before each sweep a 48 MiB buffer is written, so that each layer's
KV comes from L3 or memory as it does in a step (after the layer's weights), not from L2.
At the machine's thread count one short sequence is split by query heads over the threads
(engine/kernels/paged_decode_cpu.cpp); at 1 thread it is one item, as every single-stream
step was before that split. Rounds alternate the two; the median sweep of each is kept, and
the K/V bytes read per layer set against a torch sum over 1 GiB (the read limit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import cpu_info, git_commit
from benchmarks.quantized.bandwidth import read_bandwidth_gbs

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30


def sweep_us(kernels: Any, context: int, sweeps: int) -> list[float]:
    """Microseconds per layer of each of `sweeps` sweeps over LAYERS layers at `context`."""
    g = torch.Generator().manual_seed(context)
    blocks = -(-context // BLOCK) + 2
    caches = [
        torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    tables = torch.randperm(blocks, generator=g)[None, : -(-context // BLOCK)].contiguous()
    positions = torch.tensor([context - 1])
    last = int(tables[0, -1]) * BLOCK + (context - 1) % BLOCK
    slots, lens, rows = torch.tensor([last]), torch.tensor([context]), torch.tensor([0])
    freqs = torch.arange(8192).float()[:, None] * (
        10000 ** -(torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    )
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(torch.bfloat16)
    evict = torch.empty(48 << 20, dtype=torch.uint8)
    times = []
    for i in range(sweeps + 3):
        evict.add_(1)
        start = time.perf_counter()
        for cache in caches:
            kernels.decode_attention_step(
                qkv, positions, cos, sin, cache, slots, tables, lens, rows, HEADS, KV_HEADS,
                HEAD_DIM**-0.5,
            )  # fmt: skip
        if i >= 3:  # warm-up sweeps
            times.append((time.perf_counter() - start) / LAYERS * 1e6)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="64,128,192,256,512")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds per context")
    p.add_argument("--sweeps", type=int, default=25, help="timed sweeps per round")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from duet.engine.kernels.cpu import build_cpu_kernels

    kernels = build_cpu_kernels()
    threads = torch.get_num_threads()
    limit = read_bandwidth_gbs()
    cpu = cpu_info()
    print(
        f"{cpu['cpu_model']}; {threads} threads; read limit (torch sum over 1 GiB): {limit:.1f} GB/s"
    )
    print("context  1 thread us/layer  split us/layer  speed-up  split GB/s  of limit")
    results: dict[str, Any] = {
        "cpu": cpu,
        "commit": git_commit(),
        "threads": threads,
        "read_limit_gbs": limit,
        "contexts": {},
    }
    for context in (int(c) for c in args.contexts.split(",")):
        runs: dict[int, list[float]] = {1: [], threads: []}
        for r in range(args.rounds):
            for n in (1, threads) if r % 2 == 0 else (threads, 1):
                torch.set_num_threads(n)
                runs[n] += sweep_us(kernels, context, args.sweeps)
        torch.set_num_threads(threads)
        one, split = statistics.median(runs[1]), statistics.median(runs[threads])
        kv_bytes = 2 * context * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
        gbs = kv_bytes / split / 1e3
        print(
            f"{context:7d}  {one:17.2f}  {split:14.2f}  {one / split:7.2f}x  {gbs:10.1f}"
            f"  {gbs / limit:7.0%}"
        )
        results["contexts"][str(context)] = {
            "one_thread_us": one,
            "split_us": split,
            "speedup": one / split,
            "split_gbs": gbs,
        }
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
