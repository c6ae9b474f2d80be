"""Engine overhead per step: the wall time of the engine thread's step outside the model's
forward pass and LM head (scheduling, input preparation, sampling, output bookkeeping), at
decode batches of 1 and 64, greedy and sampled, for this tree and an earlier commit in one run.

The engine thread's step is `LLMEngine.step_outputs()` in a tree that has it (what an
`EngineCore` runs: token ids out, the text made by each stream's reader on another thread) and
`LLMEngine.step()` in one before it (text and stop strings on the engine thread).

    python -m benchmarks.offline.step_overhead                        # vs the commit issue 17 began at
    python -m benchmarks.offline.step_overhead --before f24a3dc --rounds 3 --dtype bfloat16

Each (tree, batch, sampling) cell runs in its own subprocess, loading the embedded
SmolLM2-135M-Instruct; the earlier commit is exported with `git archive` to a temporary
directory and measured by this same file with that tree first on the path. Rounds alternate
the trees, so drift of the machine falls on both. Per step: `step_ms` (all of `step()`),
`model_ms` (forward + LM head) and `overhead_ms` (the rest); medians over the measured
steps, then the median over rounds. Results: benchmarks/results/step_overhead.json.
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
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BEFORE = "f24a3dc"  # main when issue 17 (engine core, persistent input batch) began
RESULTS = REPO_ROOT / "benchmarks" / "results" / "step_overhead.json"


def measure(
    batch: int, sampled: bool, dtype: str, steps: int, warmup: int, clock: str = "wall"
) -> dict[str, float]:
    """Run in a subprocess whose path starts with the tree under test. `clock`: "wall"
    (perf_counter) or "cpu" (the calling thread's CPU time: the engine's host work is this
    thread's, so the overhead stays comparable on a machine busy with other work)."""
    import torch

    now = time.thread_time if clock == "cpu" else time.perf_counter

    from duet.engine.config import EngineConfig
    from duet.engine.llm_engine import LLMEngine
    from duet.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, load_progress=False, max_num_seqs=max(batch, 1)))
    step = getattr(engine, "step_outputs", engine.step)
    engine.assemble_outputs = False  # as under an EngineCore (an older tree ignores it)
    model = engine.runner.model
    in_model = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                in_model[0] += now() - start

        return wrapper

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.arch.vocab_size
    for i in range(batch):
        prompt = torch.randint(100, vocab - 100, (32,), generator=gen).tolist()
        if sampled:
            params = SamplingParams(
                max_tokens=steps + warmup + 8, temperature=0.8, top_p=0.95, seed=i,
                ignore_eos=True,
            )  # fmt: skip
        else:
            params = SamplingParams(max_tokens=steps + warmup + 8, temperature=0, ignore_eos=True)
        engine.add_request(prompt, params)
    # Prefill every prompt first: the measured steps are pure decode steps of `batch` rows.
    sched = engine.scheduler
    while any(r.num_output_tokens == 0 for r in [*sched.waiting, *sched.running]):
        step()
    step_ms, model_ms = [], []
    for i in range(warmup + steps):
        in_model[0] = 0.0
        start = now()
        step()
        elapsed = now() - start
        if i >= warmup:
            step_ms.append(elapsed * 1e3)
            model_ms.append(in_model[0] * 1e3)
    assert len(engine.scheduler.running) == batch, "every request decodes in every step"
    overhead = [s - m for s, m in zip(step_ms, model_ms, strict=True)]
    return {
        "step_ms": statistics.median(step_ms),
        "model_ms": statistics.median(model_ms),
        "overhead_ms": statistics.median(overhead),
    }


def _run_cell(tree: Path, args: argparse.Namespace, batch: int, sampled: bool) -> dict[str, float]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--cell",
        f"{batch},{int(sampled)}", "--dtype", args.dtype,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--clock", args.clock,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"cell {batch}/{sampled} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _export(commit: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=DEFAULT_BEFORE, help="commit to compare against")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the engine thread's CPU time (use on a machine busy with other work)",
    )
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0")
    if args.cell is not None:  # a subprocess: measure one cell with the tree on the path
        batch, sampled = (int(x) for x in args.cell.split(","))
        print(
            json.dumps(
                measure(batch, bool(sampled), args.dtype, args.steps, args.warmup, args.clock)
            )
        )
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    from benchmarks.common.machine import cpu_info, git_commit

    with tempfile.TemporaryDirectory(prefix="duet-before-") as tmp:
        before_tree = Path(tmp)
        _export(args.before, before_tree)
        trees = {"before": before_tree, "after": REPO_ROOT}
        cells: dict[str, dict[str, list[dict[str, float]]]] = {}
        for r in range(args.rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                for batch in batches:
                    for sampled in (False, True):
                        key = f"batch{batch}_{'sampled' if sampled else 'greedy'}"
                        got = _run_cell(trees[name], args, batch, sampled)
                        cells.setdefault(key, {}).setdefault(name, []).append(got)
                        print(f"round {r} {name:6s} {key:20s} {got}", flush=True)
    rows = []
    for key, by_tree in cells.items():
        row: dict[str, Any] = {"cell": key}
        for name, runs in by_tree.items():
            for field in ("step_ms", "model_ms", "overhead_ms"):
                row[f"{name}_{field}"] = statistics.median(run[field] for run in runs)
        row["overhead_ratio"] = row["after_overhead_ms"] / row["before_overhead_ms"]
        rows.append(row)
    print(f"\n{'cell':22s} {'overhead before':>16s} {'after':>8s} {'ratio':>6s}  step before/after")
    for row in rows:
        print(
            f"{row['cell']:22s} {row['before_overhead_ms']:13.2f} ms {row['after_overhead_ms']:6.2f}"
            f" ms {row['overhead_ratio']:6.2f}  {row['before_step_ms']:.1f}/{row['after_step_ms']:.1f} ms"
        )  # fmt: skip
    result = {
        "benchmark": "step_overhead",
        "before": args.before,
        "after": git_commit("engine"),
        "dtype": args.dtype,
        "clock": args.clock,
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": cpu_info(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
