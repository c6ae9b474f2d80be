"""The bf16 paged attention kernels in the AMX order against the FMA order, per call.

    python -m benchmarks.kernels.attention_order

SmolLM2's heads (9 query, 3 KV, head_dim 64), 16-token blocks scattered in the cache, 2 threads.
Cases: a prefill step of 2,048 rows (five 380-token prompts and one of 148, the step the
offline benchmark's prefill profile was taken on), decode of 64 sequences of 100-700 tokens, 64
of 150, and one of 512. Each case alternates the two orders over 3 rounds and reports the best
ms per call of each and their ratio (AMX / FMA: below 1 is faster). Exits with a message on a
CPU without AMX tiles.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.timing import ms_per_call

SHAPE = (9, 3, 64, 16)  # query heads, KV heads, head_dim, block size
SCALE = 64**-0.5


def _caches(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 K/V caches holding `lens` tokens in scattered blocks, and each sequence's table."""
    _, kv_heads, head_dim, block_size = SHAPE
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    total = sum(counts) + 3
    shape = (total, block_size, kv_heads, head_dim)
    key = torch.randn(shape, generator=g).to(torch.bfloat16)
    value = torch.randn(shape, generator=g).to(torch.bfloat16)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lens), max(counts), dtype=torch.long)
    used = 0
    for row, n in enumerate(counts):
        tables[row, :n] = perm[used : used + n]
        used += n
    return key, value, tables


def prefill_case(kernels: Any, lens: list[int]) -> Callable[[], None]:
    key, value, tables = _caches(lens, 0)
    rows = sum(lens)
    query = torch.randn(rows, SHAPE[0], SHAPE[2]).to(torch.bfloat16)
    out = torch.empty_like(query)
    seq = torch.tensor(lens)
    starts = torch.cumsum(seq, 0) - seq

    def call() -> None:
        kernels.paged_prefill_attention(out, query, key, value, tables, seq, starts, seq, SCALE)

    return call


def decode_case(kernels: Any, lens: list[int]) -> Callable[[], None]:
    key, value, tables = _caches(lens, 1)
    query = torch.randn(len(lens), SHAPE[0], SHAPE[2]).to(torch.bfloat16)
    out = torch.empty_like(query)
    seq, rows = torch.tensor(lens), torch.arange(len(lens))

    def call() -> None:
        kernels.paged_decode_attention(out, query, key, value, tables, seq, rows, SCALE)

    return call


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from duet.engine.kernels.cpu import build_cpu_kernels

    kernels = build_cpu_kernels()
    if not kernels.attention_amx_used(SHAPE[2], SHAPE[3]):
        sys.exit("this CPU (or build) has no AMX attention order: nothing to compare")
    torch.set_num_threads(args.threads)
    cases = {
        "prefill 5x380+148 tokens (2,048 rows)": (prefill_case(kernels, [380] * 5 + [148]), 20),
        "decode 64 x 100-700 tokens": (
            decode_case(kernels, [100 + (i * 37) % 600 for i in range(64)]),
            50,
        ),
        "decode 64 x 150 tokens": (decode_case(kernels, [150] * 64), 100),
        "decode 1 x 512 tokens": (decode_case(kernels, [512]), 400),
    }
    results = {}
    try:
        for name, (call, reps) in cases.items():
            times: dict[str, list[float]] = {"fma": [], "amx": []}
            for r in range(args.rounds):
                for order in ("fma", "amx") if r % 2 == 0 else ("amx", "fma"):
                    kernels.attention_amx(order == "amx")
                    times[order].append(ms_per_call(call, reps))
            fma, amx = min(times["fma"]), min(times["amx"])
            results[name] = {"fma_ms": fma, "amx_ms": amx, "amx_over_fma": amx / fma}
            print(f"{name}: FMA order {fma:.3f} ms, AMX order {amx:.3f} ms, ratio {amx / fma:.2f}")
    finally:
        kernels.attention_amx(True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
