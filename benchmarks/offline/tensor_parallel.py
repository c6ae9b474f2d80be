"""`python -m benchmarks.offline.throughput --tensor-parallel-size N`: duet at N ranks against
one rank, on the same workload and the same cores (each rank gets 1/N of `--threads`: one core
per rank at N = 2 on a 2-core machine), both engines loaded once and timed in alternating
rounds (benchmarks/offline/paired.py). Per round: each engine's output tokens/s and step time,
and the N-rank engine's step split into communication (rank 0's time inside collectives:
the all-reduces after attention and the MLP, the logits' gather, the sampled tokens' and
commands' broadcasts, including waiting for the other ranks to arrive) and the rest, compute."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.machine import write_json
from benchmarks.offline.paired import DuetEngine, run_rounds
from benchmarks.offline.systems import RunConfig
from benchmarks.offline.workload import Workload

DEFAULT_ROUNDS = 3


def step_split(record: dict[str, Any]) -> dict[str, float]:
    """One engine's timed call per engine step: wall, communication and compute milliseconds
    (communication is 0 at one rank)."""
    steps = record["num_steps"]
    step_ms = 1e3 * record["wall_s"] / steps
    comm_ms = 1e3 * record.get("collective_s", 0.0) / steps
    return {"step_ms": step_ms, "comm_ms": comm_ms, "compute_ms": step_ms - comm_ms}


def compare(
    workload: Workload, dtype: str, cfg: RunConfig, size: int, rounds: int, idle_wait_s: float
) -> dict[str, Any]:
    """`rounds` alternating rounds of duet at `size` ranks and at one rank, in `dtype`."""
    names = (f"tp{size}", "tp1")
    engines: dict[str, DuetEngine] = {}
    try:
        for name, ranks in zip(names, (size, 1), strict=True):
            print(f"loading duet {dtype} at {ranks} rank(s) ...", flush=True)
            engines[name] = DuetEngine(
                workload, dtype, dataclasses.replace(cfg, tensor_parallel_size=ranks)
            )
        pair = run_rounds(dict(engines), workload, rounds, idle_wait_s)
    finally:
        for engine in engines.values():
            engine.close()
        gc.collect()
    tokens = pair.pop("token_ids")
    pair["same_tokens_as_one_rank"] = sum(
        a == b for a, b in zip(tokens[names[0]], tokens[names[1]], strict=True)
    )
    pair["num_prompts"] = len(tokens[names[0]])
    for record in pair["rounds"]:
        for name in names:
            record[name].update(step_split(record[name]))
    pair["median_comm_fraction"] = statistics.median(
        r[names[0]]["comm_ms"] / r[names[0]]["step_ms"] for r in pair["rounds"]
    )
    return {"dtype": dtype, **pair}


def run_tensor_parallel(
    args: argparse.Namespace,
    workload: Workload,
    cfg: RunConfig,
    model_dir: Path,
    machine: dict[str, Any],
    command: str,
    dtypes: list[str],
) -> None:
    """Each dtype's comparison, printed and written to `args.out` (naming `command`)."""
    size, rounds = args.tensor_parallel_size, args.paired_rounds or DEFAULT_ROUNDS
    results = [compare(workload, d, cfg, size, rounds, args.idle_wait_s) for d in dtypes]
    print_results(results)
    report = {
        "benchmark": "offline_throughput_tensor_parallel",
        "command": command,
        "machine": machine,
        "config": {
            "model_dir": str(model_dir),
            "tensor_parallel_size": size,
            "rounds": rounds,
            "threads": cfg.num_threads,
            "threads_per_rank": max(1, cfg.num_threads // size),
        },
        "workload": workload.summary(),
        "results": results,
    }
    write_json(args.out, report)


def print_results(results: list[dict[str, Any]]) -> None:
    header = (
        f"{'dtype':<9} {'round':>5} {'engine':<6} {'tok/s':>8} {'step ms':>8} "
        f"{'comm ms':>8} {'compute ms':>10} {'others':>6}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for result in results:
        for k, record in enumerate(result["rounds"]):
            for name in result["engines"]:
                r = record[name]
                print(
                    f"{result['dtype']:<9} {k + 1:>5} {name:<6} {r['tok_s']:8.1f} "
                    f"{r['step_ms']:8.2f} {r['comm_ms']:8.2f} {r['compute_ms']:10.2f} "
                    f"{r['cpu']['other_cores']:6.2f}"
                )
        many, one = result["engines"]
        print(
            f"{result['dtype']}: {many}/{one} tok/s median {result['median_ratio']:.2f}x "
            f"({result['min_ratio']:.2f}-{result['max_ratio']:.2f}); communication "
            f"{result['median_comm_fraction']:.0%} of {many}'s step (median); outputs equal to "
            f"one rank's: {result['same_tokens_as_one_rank']}/{result['num_prompts']}"
        )
    print(
        "comm ms: rank 0's time inside collectives per engine step (waiting for the other "
        "ranks included); compute ms: the rest of the step; others: cores used by other "
        "processes during the call (every rank counts as the system's own)"
    )
