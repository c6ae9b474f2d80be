"""duet against an earlier commit of itself, in paired rounds: what a change costs or gains.

    python -m benchmarks.offline.versus_commit --before 2df11e9 --dtype both --rounds 4

Each tree (this one, and the earlier commit exported with `git archive`) runs in its own
process with its own `LLM` loaded once, on the embedded SmolLM2-135M-Instruct exported to an HF
directory (as `benchmarks.offline.throughput` loads it). Each round times, on each tree, in
alternating order: the offline workload of
`benchmarks.offline.throughput` (64 prompts, prompts 16-512 tokens, outputs 16-256, greedy) and
one stream (a 64-token prompt, 128 new tokens). Each round spawns both workers afresh, in
alternating order, and the order the trees run in alternates every two rounds, so every
(spawn order, run order) pair occurs equally in a multiple of four rounds: a worker spawned
first ran 7-14% slower than one spawned second on the AMX Xeon VM, whatever tree it held (this
tree against itself: 0.86x with one spawn order, 1.07x with the other; hence `--rounds` must be
even). Both prefix caches are emptied before every timed call, and the machine is waited on to
be idle before each. The ratio after/before is
taken within each round; their median and geometric mean (in which opposite spawn-order biases
cancel) go to benchmarks/results/versus_commit.json.

`--model-dir` measures another HF directory (the mixture of experts of
benchmarks/offline/moe_model.py, say), with `--prompt-len`, `--output-len` and `--max-num-seqs`
shaping the offline workload.

The worker half (`--worker`) imports nothing but `engine` (the tree under test) and the
standard library, so any commit with today's `engine.LLM` API can be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "versus_commit.json"
SINGLE_PROMPT_LEN, SINGLE_NEW_TOKENS = 64, 128


def worker(spec_path: str) -> None:
    """Load the LLM the spec describes, then answer `run <workload>` lines on stdin with one
    JSON line each ({"wall_s", "token_ids"}); `quit` ends it."""
    from duet.engine import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(spec["model_dir"], load_progress=False, **spec["engine"])
    warm = spec["workloads"]["warmup"]
    llm.generate(
        warm["prompts"], [SamplingParams(max_tokens=8, ignore_eos=True)] * len(warm["prompts"])
    )
    print(
        json.dumps({"ready": True, "deterministic": getattr(llm.engine, "deterministic", None)}),
        flush=True,
    )
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            return
        load = spec["workloads"][cmd[1]]
        params = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in load["max_tokens"]
        ]
        if not llm.engine.kv.pool.reset_prefix_cache():
            raise RuntimeError("KV blocks still held between timed calls")
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = llm.generate(load["prompts"], params)
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        tokens = [o.token_ids for o in outs]
        print(json.dumps({"wall_s": wall_s, "cpu_s": cpu_s, "token_ids": tokens}), flush=True)


class Tree:
    """One tree's worker process."""

    def __init__(self, name: str, root: Path, spec_path: Path) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.ready = self._read(timeout_s=900)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(out, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"{self.name}: no answer within {timeout_s:g}s")
            line = out.readline()
            if not line:
                raise RuntimeError(f"{self.name}: worker exited ({self.proc.wait(10)})")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, workload: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {workload}\n")
        self.proc.stdin.flush()
        return self._read(timeout_s=1800)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(60)


def _export(commit: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _workloads(
    model_dir: Path, seed: int, num_prompts: int, lengths: dict[str, tuple[int, int]]
) -> dict[str, dict[str, Any]]:
    from benchmarks.offline.workload import make_workload, special_token_ids, vocab_size

    vocab, special = vocab_size(model_dir), special_token_ids(model_dir)
    offline = make_workload(num_prompts, seed, vocab, special, **lengths)
    single = make_workload(1, seed + 7, vocab, special, (SINGLE_PROMPT_LEN,) * 2,
                           (SINGLE_NEW_TOKENS,) * 2)  # fmt: skip
    warmup = make_workload(2, seed + 1_000_003, vocab, special, (32, 32), (8, 8))
    return {
        name: {"prompts": w.prompts, "max_tokens": w.max_tokens}
        for name, w in (("offline", offline), ("single", single), ("warmup", warmup))
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=None, help="the earlier commit (required)")
    p.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--num-prompts", type=int, default=64, help="of the offline workload")
    p.add_argument("--prompt-len", default=None, metavar="LO,HI",
                   help="of the offline workload (default: the throughput benchmark's)")  # fmt: skip
    p.add_argument("--output-len", default=None, metavar="LO,HI",
                   help="of the offline workload (default: the throughput benchmark's)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="each tree's KV pool")
    p.add_argument(
        "--model-dir", type=Path, default=None,
        help="an HF model directory (default: the embedded SmolLM2 exported to one)",
    )  # fmt: skip
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="time per call: wall, or the worker's CPU time (with --threads 1, robust to other "
        "processes on a shared machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization", default=None, choices=["int8", "int4", "gguf"],
        help="both trees load quantized weights (the LM head too), as `LLM(quantization=...)`",
    )  # fmt: skip
    p.add_argument("--idle-wait-s", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    if args.before is None:
        p.error("--before: required (the earlier commit)")
    if args.rounds < 2 or args.rounds % 2:
        p.error(f"--rounds: must be even and >= 2 (spawn order alternates); got {args.rounds}")
    from benchmarks.common.cpu_usage import wait_for_idle
    from benchmarks.common.machine import cpu_info
    from benchmarks.offline.smollm2_hf import export_hf_dir

    model_dir = export_hf_dir() if args.model_dir is None else args.model_dir
    from benchmarks.offline.throughput import FULL_LENGTHS, _length_range

    lengths = dict(FULL_LENGTHS)
    for name in ("prompt_len", "output_len"):
        if getattr(args, name) is not None:
            lengths[name] = _length_range(getattr(args, name))
    workloads = _workloads(model_dir, args.seed, args.num_prompts, lengths)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    report: dict[str, Any] = {
        "before": args.before,
        "clock": args.clock,
        "threads": args.threads,
        "num_prompts": args.num_prompts,
        "model_dir": str(model_dir),
        **lengths,
        "max_num_seqs": args.max_num_seqs,
        "quantization": args.quantization,
        "machine": cpu_info(),
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="duet-before-") as tmp:
        _export(args.before, Path(tmp))
        for dtype in dtypes:
            spec = {
                "model_dir": str(model_dir),
                "engine": dict(
                    dtype=dtype,
                    num_threads=args.threads,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=2048,
                    kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
                    max_model_len=1024,
                    seed=args.seed,
                    **(
                        {"quantization": args.quantization, "quantize_lm_head": True}
                        if args.quantization
                        else {}
                    ),
                ),
                "workloads": workloads,
            }
            spec_path = Path(tmp) / f"spec-{dtype}.json"
            spec_path.write_text(json.dumps(spec))
            rounds: dict[str, list[dict[str, float]]] = {"offline": [], "single": []}
            for r in range(args.rounds):
                # Fresh workers every round, spawned in alternating order: on the AMX Xeon VM the
                # worker spawned first ran 7-14% slower than the one spawned second, whichever
                # tree it held (this tree against itself: 0.86x one way, 1.07x the other).
                roots = [("after", REPO_ROOT), ("before", Path(tmp))]
                trees = []
                try:
                    for name, root in roots if r % 2 == 0 else roots[::-1]:
                        trees.append(Tree(name, root, spec_path))
                    if r == 0:
                        ready = {t.name: t.ready.get("deterministic") for t in trees}
                        print(f"{dtype}: deterministic before={ready['before']} "
                              f"after={ready['after']}", flush=True)  # fmt: skip
                    for name, load in workloads.items():
                        if name == "warmup":
                            continue
                        num_tokens = sum(load["max_tokens"])
                        walls: dict[str, float] = {}
                        outputs: dict[str, list[list[int]]] = {}
                        for tree in trees if r % 4 < 2 else trees[::-1]:
                            wait_for_idle(args.idle_wait_s)
                            answer = tree.run(name)
                            walls[tree.name] = answer[f"{args.clock}_s"]
                            outputs[tree.name] = answer["token_ids"]
                        cell = {f"{k}_tok_s": num_tokens / v for k, v in walls.items()}
                        cell["ratio"] = cell["after_tok_s"] / cell["before_tok_s"]
                        cell["same_tokens"] = float(outputs["after"] == outputs["before"])
                        rounds[name].append(cell)
                        print(f"round {r} {dtype} {name:8s} " + " ".join(
                            f"{k}={v:.3f}" for k, v in cell.items()), flush=True)  # fmt: skip
                finally:
                    for tree in trees:
                        tree.close()
            report["results"][dtype] = {
                name: {"rounds": cells,
                       "median_ratio": statistics.median(c["ratio"] for c in cells),
                       "geomean_ratio": statistics.geometric_mean(c["ratio"] for c in cells),
                       "median_after_tok_s": statistics.median(c["after_tok_s"] for c in cells),
                       "median_before_tok_s": statistics.median(c["before_tok_s"] for c in cells)}
                for name, cells in rounds.items()
            }  # fmt: skip
    print("\ndtype      workload  before tok/s  after tok/s  after/before: median, geomean")
    for dtype, res in report["results"].items():
        for name, r in res.items():
            print(f"{dtype:<10} {name:<9} {r['median_before_tok_s']:12.1f} "
                  f"{r['median_after_tok_s']:12.1f}  {r['median_ratio']:.3f}, "
                  f"{r['geomean_ratio']:.3f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
