"""bf16 attention in the AMX order against the FMA order, in one process.

One `LLM` (bf16) runs each workload with the kernels' AMX attention order switched on and off
(`attention_amx` in the CPU kernel module), alternating the order each round, so both see the
same machine state; the FMA order is the baseline. The two orders round differently, so greedy
tokens may differ between them; each order's tokens must be the same in every round.

    python -m benchmarks.offline.attention_order --rounds 3

Workloads (64 prompts, seeded, as `benchmarks.offline.throughput`): mixed (16-512 prompt tokens,
16-256 output), prefill (256-512, 1 output token), decode (16-32, 200-256 output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.offline.smollm2_hf import DEFAULT_CACHE_DIR, export_hf_dir
from benchmarks.offline.systems import RunConfig, load_duet, time_duet
from benchmarks.offline.throughput import machine_info
from benchmarks.offline.workload import make_workload, special_token_ids, vocab_size

WORKLOADS = {
    "mixed": ((16, 512), (16, 256)),
    "prefill": ((256, 512), (1, 1)),
    "decode": ((16, 32), (200, 256)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each order per workload")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS)
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; allowed {sorted(WORKLOADS)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None or not kernels.attention_amx_used(64, 16):
        sys.exit("this CPU (or build) has no AMX attention order: nothing to compare")
    model_dir = export_hf_dir(args.model_dir)
    vocab, special = vocab_size(model_dir), special_token_ids(model_dir)
    warmup = make_workload(2, 1_000_003, vocab, special, (32, 32), (8, 8))
    cfg = RunConfig(
        model_dir=model_dir, num_threads=args.threads, max_num_seqs=64,
        max_num_batched_tokens=2048, kv_cache_memory_bytes=4 << 30, max_model_len=1024,
        warmup_prompts=warmup.prompts,
    )  # fmt: skip
    llm, _, _ = load_duet("bfloat16", cfg)
    result: dict[str, Any] = {"machine": machine_info(args.threads), "workloads": {}}
    print(result["machine"])
    try:
        for name in args.workloads.split(","):
            prompt_len, output_len = WORKLOADS[name]
            workload = make_workload(args.num_prompts, 0, vocab, special, prompt_len, output_len)
            tokens: dict[str, list[list[int]]] = {}
            walls: dict[str, list[float]] = {"amx": [], "fma": []}
            for r in range(args.rounds):
                order = ("amx", "fma") if r % 2 == 0 else ("fma", "amx")
                for which in order:
                    kernels.attention_amx(which == "amx")
                    wall, _, ids, _ = time_duet(llm, workload)
                    if tokens.setdefault(which, ids) != ids:
                        raise RuntimeError(f"{name}: the {which} order's tokens changed")
                    walls[which].append(wall)
                    print(f"  {name} round {r + 1} {which}: {wall:.2f} s", flush=True)
            ratios = [f / a for a, f in zip(walls["amx"], walls["fma"], strict=True)]
            same = sum(a == b for a, b in zip(tokens["amx"], tokens["fma"], strict=True))
            summary = {
                "summary": workload.summary(),
                "amx_s": walls["amx"],
                "fma_s": walls["fma"],
                "speedup_median": statistics.median(ratios),
                "speedups": ratios,
                "sequences_identical_between_orders": same,
            }
            result["workloads"][name] = summary
            print(
                f"{name}: AMX order {min(walls['amx']):.2f} s, FMA order {min(walls['fma']):.2f} s"
                f" (best of {args.rounds}); speed-up median {summary['speedup_median']:.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}); {same}/{len(ratios and tokens['amx'])} "
                "sequences identical between the orders",
                flush=True,
            )
    finally:
        kernels.attention_amx(True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
