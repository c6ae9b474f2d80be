"""What the block allocator's eviction window buys and costs, against strict LRU, in one run.

`BlockPool.get_new_blocks` (engine/block_pool.py) takes n blocks among the `eviction_window`
x n least recently freed, the ones that make the fewest runs of consecutive ids; window 1 is
strict LRU (the queue's front n). Two measurements, each for window 1 and the default:

- **runs**: a table of `--blocks` blocks after the KV transfer benchmark's churn
  (`transfer_measure.churned_table`: random prompts, growth a block at a time, frees, in a
  pool of `--pool-blocks`): its runs of consecutive ids, each one span (one transport
  operation per layer and plane) of a KV transfer;
- **prefix hits**: the share of prompt tokens served from the prefix cache in a chat-like
  workload (`--requests` requests, 8 at a time, each a system prompt of 6 blocks drawn
  Zipf-like from 50 followed by 1-30 blocks of its own, then 1-20 blocks of decode a token a
  step, in a pool of `--cache-blocks`): what the looser eviction order costs.

    python -m benchmarks.kv.allocator [--seeds 20] [--out benchmarks/results/allocator.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.kv.transfer_measure import churned_table
from duet.engine.block_pool import EVICTION_WINDOW
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.request import Request
from duet.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
SYSTEM_PROMPTS = 50
SYSTEM_BLOCKS = 6
RUNNING = 8


def num_runs(ids: Sequence[int]) -> int:
    """Runs of consecutive ids in a table (ascending within each run)."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0


def table_runs(pool: int, num_blocks: int, seed: int, window: int) -> int:
    rng = random.Random(seed * 1_000_003 + num_blocks)  # as `--block-order pool` seeds it
    return num_runs(churned_table(pool, num_blocks, rng, window))


def prefix_hit_rate(num_blocks: int, requests: int, seed: int, window: int) -> float:
    """Prompt tokens served from the prefix cache / prompt tokens (see the module note)."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, eviction_window=window)
    rng = random.Random(seed)
    systems = [
        [rng.randrange(1000, 30000) for _ in range(SYSTEM_BLOCKS * BLOCK_SIZE)]
        for _ in range(SYSTEM_PROMPTS)
    ]
    weights = [1 / (i + 1) for i in range(SYSTEM_PROMPTS)]
    running: list[tuple[Request, list[int]]] = []  # (request, [decode tokens left])
    admitted = hits = queries = 0
    while admitted < requests or running:
        while admitted < requests and len(running) < RUNNING:
            own = [rng.randrange(30000, 60000) for _ in range(rng.randint(1, 30) * BLOCK_SIZE)]
            tokens = rng.choices(systems, weights)[0] + own
            request = Request(f"r{admitted}", tokens, SamplingParams(max_tokens=1024), 1024)
            cached, num_hit = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, len(tokens) - num_hit, cached) is None:
                break  # full: the running ones finish first
            admitted += 1
            hits, queries = hits + num_hit, queries + len(tokens)
            request.num_computed_tokens = len(tokens)
            kv.cache_blocks(request, len(tokens))
            running.append((request, [rng.randint(1, 20) * BLOCK_SIZE]))
        for entry in list(running):
            request, left = entry
            request.append_output_token(7)
            left[0] -= 1
            if left[0] <= 0 or kv.allocate_slots(request, 1) is None:
                kv.free(request)
                running.remove(entry)
            else:
                request.num_computed_tokens += 1
    return hits / queries


def measure(args: argparse.Namespace) -> dict[str, Any]:
    windows = sorted({1, EVICTION_WINDOW})
    out: dict[str, Any] = {"config": vars(args), "windows": {}}
    for window in windows:
        runs = [table_runs(args.pool_blocks, args.blocks, s, window) for s in range(args.seeds)]
        rates = [
            prefix_hit_rate(args.cache_blocks, args.requests, s, window)
            for s in range(args.hit_seeds)
        ]
        out["windows"][str(window)] = {
            "runs": runs, "runs_mean": statistics.mean(runs),
            "hit_rates": rates, "hit_rate_mean": statistics.mean(rates),
        }  # fmt: skip
    strict, default = out["windows"]["1"], out["windows"][str(EVICTION_WINDOW)]
    out["runs_ratio"] = default["runs_mean"] / strict["runs_mean"]
    out["hit_rate_ratio"] = default["hit_rate_mean"] / strict["hit_rate_mean"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv.allocator", description=__doc__)
    p.add_argument("--blocks", type=int, default=256, help="the transferred table's blocks")
    p.add_argument("--pool-blocks", type=int, default=1024, help="the churned pool")
    p.add_argument("--seeds", type=int, default=20, help="churned tables per window")
    p.add_argument("--cache-blocks", type=int, default=400, help="the prefix workload's pool")
    p.add_argument("--requests", type=int, default=3000, help="prefix workload requests")
    p.add_argument("--hit-seeds", type=int, default=4, help="prefix workloads per window")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args(argv)
    result = measure(args)
    for window, got in result["windows"].items():
        name = "strict LRU" if window == "1" else f"window {window}x"
        print(
            f"{name:>12}: {got['runs_mean']:6.1f} runs in {args.blocks} blocks (min "
            f"{min(got['runs'])}, max {max(got['runs'])}); prefix hit rate "
            f"{got['hit_rate_mean']:.4f}"
        )
    print(
        f"window {EVICTION_WINDOW}x / strict: runs x{result['runs_ratio']:.3f}, "
        f"prefix hit rate x{result['hit_rate_ratio']:.4f}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
