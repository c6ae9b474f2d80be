"""Offline throughput on a mixture of experts: duet's `engine.LLM` against HF transformers'
`generate` on a random-weight Qwen3-MoE model (benchmarks/offline/moe_model.py), both in
bf16 and fp32, at one batch size, in one run.

    python -m benchmarks.offline.moe_throughput                 # ~1.4B parameters, batch 32
    python -m benchmarks.offline.moe_throughput --rounds 2 --dtype bfloat16

Workload: `--num-prompts` prompts of random token ids (lengths uniform in `--prompt-len`),
each generating its own number of tokens (`--output-len`), greedy, ignore_eos. duet runs
continuous batching with at most `--batch-size` sequences; HF runs static batches of
`--batch-size`, left-padded, each to its longest output (only the requested tokens count).

Only one model is in memory at a time (a 1.4B fp32 model is 5.7 GB): each system loads,
warms up, times one call that generates the whole workload, and is freed. Each round runs
every dtype, the systems in alternating order (duet first in even rounds), and the ratio is
duet's tokens/s over HF's within the round and dtype. The load average (`os.getloadavg`)
and the cores other processes used during each timed call are recorded: the machine may be
shared. Results: benchmarks/results/moe_throughput.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common.machine import write_json
from benchmarks.offline.moe_model import DEFAULT_DIR, MoEShapes, build_moe_dir
from benchmarks.offline.results_table import agreement
from benchmarks.offline.systems import (
    WARMUP_MAX_TOKENS,
    RunConfig,
    SystemResult,
    run_duet,
    run_hf,
)
from benchmarks.offline.throughput import DTYPES, REPO_ROOT, _length_range, machine_info
from benchmarks.offline.workload import make_workload

COMMAND = ["python", "-m", "benchmarks.offline.moe_throughput"]
HF_EXPERTS = ("default", "eager", "grouped_mm", "batched_mm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=_length_range, default=(16, 128), metavar="LO,HI")
    p.add_argument("--output-len", type=_length_range, default=(32, 64), metavar="LO,HI")
    p.add_argument("--batch-size", type=int, default=32, help="duet's max_num_seqs, HF's batch")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="both")
    p.add_argument("--rounds", type=int, default=1, help="each system per dtype per round")
    p.add_argument(
        "--hf-experts", choices=HF_EXPERTS, default="default",
        help="HF's experts_implementation ('default': what from_pretrained picks)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/moe_throughput.json")
    for f in fields(MoEShapes):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    args = p.parse_args(argv)
    for name in ("num_prompts", "batch_size", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1; got {getattr(args, name)}")
    return args


def shapes_of(args: argparse.Namespace) -> MoEShapes:
    return MoEShapes(**{f.name: getattr(args, f.name) for f in fields(MoEShapes)})


def run_rounds(
    jobs: dict[str, dict[str, Callable[[], SystemResult]]], rounds: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """For each round and dtype, each system's job (`jobs[dtype][system]`, "duet" and "hf"), in
    alternating order: one row per (round, dtype) with both results and duet's ratio."""
    rows: list[dict[str, Any]] = []
    for k in range(rounds):
        for dtype, by_system in jobs.items():
            order = ["duet", "hf"] if k % 2 == 0 else ["hf", "duet"]
            results: dict[str, SystemResult] = {}
            for system in order:
                before = os.getloadavg()[0]
                result = by_system[system]()
                result.details["loadavg_1m"] = [before, os.getloadavg()[0]]
                results[system] = result
                gc.collect()  # one model in memory at a time
                log(
                    f"  round {k} {dtype} {system}: {result.output_tokens_per_s:.1f} tok/s "
                    f"(wall {result.wall_s:.1f} s, others {result.details['cpu']['other_cores']:.2f} "
                    f"cores, load {before:.2f})"
                )
            duet, hf = results["duet"], results["hf"]
            duet.details["agreement"] = agreement(duet, hf)
            rows.append({
                "round": k, "dtype": dtype, "order": order,
                "ratio": duet.output_tokens_per_s / hf.output_tokens_per_s,
                "duet": duet, "hf": hf,
            })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per dtype: the median ratio and tokens/s of each system over the rounds."""
    out: dict[str, dict[str, float]] = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        out[dtype] = {
            "median_ratio": statistics.median(r["ratio"] for r in mine),
            "duet_tok_s": statistics.median(r["duet"].output_tokens_per_s for r in mine),
            "hf_tok_s": statistics.median(r["hf"].output_tokens_per_s for r in mine),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    shapes = shapes_of(args)
    model_dir = build_moe_dir(args.model_dir, shapes, args.seed)
    special: set[int] = set()
    workload = make_workload(args.num_prompts, args.seed, shapes.vocab_size, special,
                             args.prompt_len, args.output_len)  # fmt: skip
    warmup = make_workload(2, args.seed + 1_000_003, shapes.vocab_size, special, (16, 16),
                           (WARMUP_MAX_TOKENS,) * 2)  # fmt: skip
    cfg = RunConfig(
        model_dir=model_dir,
        num_threads=args.threads,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=max(workload.max_model_len, warmup.max_model_len),
        warmup_prompts=warmup.prompts,
        seed=args.seed,
    )
    machine = machine_info(args.threads)
    hf_experts = None if args.hf_experts == "default" else args.hf_experts
    print(f"model {model_dir}: {shapes.num_parameters() / 1e9:.2f}B parameters "
          f"({shapes.num_active_parameters() / 1e6:.0f}M active); workload {workload.summary()}; "
          f"batch {args.batch_size}; threads {args.threads}", flush=True)  # fmt: skip
    jobs = {
        dtype: {
            "duet": partial(run_duet, workload, dtype, cfg),
            "hf": partial(run_hf, workload, args.batch_size, cfg, dtype, hf_experts),
        }
        for dtype in DTYPES[args.dtype]
    }
    rows = run_rounds(jobs, args.rounds, lambda line: print(line, flush=True))
    summary = summarize(rows)
    print(f"\n{'dtype':<9} {'duet tok/s':>10} {'HF tok/s':>9} {'duet/HF':>8}")
    for dtype, s in summary.items():
        print(f"{dtype:<9} {s['duet_tok_s']:10.1f} {s['hf_tok_s']:9.1f} {s['median_ratio']:7.2f}x")
    hf_impl = rows[0]["hf"].details.get("experts_implementation")
    print(f"HF experts implementation: {hf_impl}; load average {os.getloadavg()}")
    report = {
        "benchmark": "moe_throughput",
        "command": shlex.join([*COMMAND, *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine,
        "shapes": {
            **shapes.__dict__,
            "num_parameters": shapes.num_parameters(),
            "num_active_parameters": shapes.num_active_parameters(),
        },
        "config": {
            "batch_size": args.batch_size,
            "dtypes": DTYPES[args.dtype],
            "rounds": args.rounds,
            "hf_experts_implementation": hf_impl,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "workload": workload.summary(),
        "rounds": [{**r, "duet": r["duet"].to_json(), "hf": r["hf"].to_json()} for r in rows],
        "summary": summary,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
