"""`python -m benchmarks.offline.throughput --paired-rounds N`: duet against compiled or eager
vLLM, both loaded once, timed in alternating rounds (benchmarks/offline/paired.py), so drift of
a shared machine falls on both; the median ratio over the rounds is the result."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

from benchmarks.common.machine import write_json
from benchmarks.offline.paired import DuetEngine, VllmEngine, run_rounds
from benchmarks.offline.systems import RunConfig, SystemUnavailable, check_vllm
from benchmarks.offline.workload import Workload


def run_paired(
    args: argparse.Namespace,
    workload: Workload,
    cfg: RunConfig,
    model_dir: Path,
    machine: dict[str, Any],
    command: str,
    dtypes: list[str],
) -> None:
    """duet against each vLLM engine in alternating rounds, one dtype at a time; the report
    (naming `command`) goes to `args.out`."""
    try:
        version = check_vllm(args.vllm_python)
    except SystemUnavailable as e:
        raise SystemExit(f"--paired-rounds needs the vLLM baseline: {e}") from None
    print(f"vllm {version} under {args.vllm_python}; {args.paired_rounds} paired rounds")
    pairs = []
    for dtype in dtypes:
        duet = DuetEngine(workload, dtype, cfg)
        try:
            for mode in args.vllm_modes:
                name = f"vllm-{mode}"
                print(f"loading {name} {dtype} ...", flush=True)
                vllm = VllmEngine(workload, dtype, mode == "eager", args.vllm_python, cfg)
                try:
                    pair = run_rounds(
                        {"duet": duet, name: vllm}, workload, args.paired_rounds, args.idle_wait_s
                    )
                finally:
                    vllm.close()
                tokens = pair.pop("token_ids")
                pair["same_tokens_as_vllm"] = sum(
                    a == b for a, b in zip(tokens["duet"], tokens[name], strict=True)
                )
                pairs.append({"dtype": dtype, "baseline": name, **pair})
                varied = [
                    e for e, same in pair["same_tokens_every_round_by_engine"].items() if not same
                ]
                print(
                    f"duet/{name} {dtype}: median {pair['median_ratio']:.2f}x "
                    f"({pair['min_ratio']:.2f}-{pair['max_ratio']:.2f}) over "
                    f"{args.paired_rounds} rounds; tokens changed between rounds: "
                    f"{', '.join(varied) or 'neither'}",
                    flush=True,
                )
        finally:
            duet.close()
            gc.collect()
    print_paired(pairs)
    report = {
        "benchmark": "offline_throughput_paired",
        "command": command,
        "machine": machine,
        "config": {"model_dir": str(model_dir), "rounds": args.paired_rounds},
        "workload": workload.summary(),
        "pairs": pairs,
    }
    write_json(args.out, report)


def print_paired(pairs: list[dict[str, Any]]) -> None:
    header = f"{'pair':<26} {'dtype':<9} {'duet tok/s':>24} {'baseline tok/s':>24} {'ratio':>16}"
    print("\n" + header + "\n" + "-" * len(header))
    for pair in pairs:
        duet_name, base = pair["engines"]
        duet_tok = [r[duet_name]["tok_s"] for r in pair["rounds"]]
        base_tok = [r[base]["tok_s"] for r in pair["rounds"]]
        print(
            f"{'duet / ' + base:<26} {pair['dtype']:<9} "
            f"{min(duet_tok):>10.1f}-{max(duet_tok):<10.1f}   "
            f"{min(base_tok):>10.1f}-{max(base_tok):<10.1f}   "
            f"{pair['median_ratio']:>5.2f}x ({pair['min_ratio']:.2f}-{pair['max_ratio']:.2f})"
        )
    print("ratio: median (min-max) over the rounds of duet tok/s / baseline tok/s in the round")
