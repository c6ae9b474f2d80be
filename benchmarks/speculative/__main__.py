"""Output tokens/s with and without ngram speculative decoding, in one run.

    python -m benchmarks.speculative                        # default model (SmolLM2-135M)
    python -m benchmarks.speculative --model PATH --batch-sizes 1 --max-tokens 8   # smoke

Both engines (with and without `--speculative-config`) stay loaded and are measured in
alternating rounds on the same prompts, so the machine's drift hits both alike. For each
workload (copy-heavy, open chat; `benchmarks/speculative/workload.py`) and batch size, the
same `--num-prompts` conversations are generated greedily in groups of the batch size
(`max_num_seqs` = batch size, ignore_eos, `--max-tokens` each). Reported: output tokens/s of
each engine, their ratio (median over rounds), the acceptance rate and accepted tokens per
verification, and whether the tokens were identical (they must be: greedy). Results go to
benchmarks/results/speculative.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit
from benchmarks.speculative.workload import WORKLOADS, prompts
from duet.engine import LLM, SamplingParams

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "speculative.json"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a comma list of integers; got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1; got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16])
    p.add_argument("--workloads", default="copy,chat")
    p.add_argument("--num-prompts", type=int, default=16, help="conversations per batch size")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--speculative-config",
        default='{"method": "ngram", '
        '"num_speculative_tokens": 16, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1; got {getattr(args, name)}")
    args.workloads = args.workloads.split(",")
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"--workloads: unknown {bad[0]!r}; known: {', '.join(WORKLOADS)}")
    try:
        args.speculative_config = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        p.error(f"--speculative-config: not valid JSON ({e})")
    return args


def _run(llm: LLM, convs: list, batch: int, params: SamplingParams) -> tuple[float, list]:
    tokens = []
    start = time.perf_counter()
    for i in range(0, len(convs), batch):
        tokens += [o.outputs[0].token_ids for o in llm.chat(convs[i : i + batch], params)]
    return time.perf_counter() - start, tokens


def measure(args: argparse.Namespace, workload: str, batch: int) -> dict[str, Any]:
    common = dict(dtype=args.dtype, load_progress=False, max_num_seqs=batch)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=args.speculative_config, **common)
    convs = prompts(workload, max(args.num_prompts, batch))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    _run(plain, convs[:batch], batch, params)  # warm-up both
    _run(spec, convs[:batch], batch, params)
    stats = spec.engine.stats.spec_decode
    assert stats is not None
    drafted0, accepted0, drafts0 = (
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        stats.num_drafts,
    )
    rounds = []
    same = True
    for _ in range(args.rounds):
        plain_s, plain_tokens = _run(plain, convs, batch, params)
        spec_s, spec_tokens = _run(spec, convs, batch, params)
        same = same and plain_tokens == spec_tokens
        num_tokens = sum(len(t) for t in plain_tokens)
        rounds.append({"plain_tok_s": num_tokens / plain_s, "spec_tok_s": num_tokens / spec_s,
                       "ratio": plain_s / spec_s})  # fmt: skip
    drafted = stats.num_draft_tokens - drafted0
    accepted = stats.num_accepted_tokens - accepted0
    drafts = stats.num_drafts - drafts0
    return {
        "workload": workload,
        "batch": batch,
        "rounds": rounds,
        "plain_tok_s": statistics.median(r["plain_tok_s"] for r in rounds),
        "spec_tok_s": statistics.median(r["spec_tok_s"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_per_verification": accepted / drafts if drafts else 0.0,
        "num_draft_tokens": drafted,
        "identical_tokens": same,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    print(f"{'workload':>8} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>6} {'same':>5}")  # fmt: skip
    for workload in args.workloads:
        for batch in args.batch_sizes:
            row = measure(args, workload, batch)
            rows.append(row)
            print(f"{workload:>8} {batch:>5} {row['plain_tok_s']:>11.1f} {row['spec_tok_s']:>10.1f} "
                  f"{row['ratio']:>6.2f} {row['acceptance_rate']:>6.2f} "
                  f"{row['identical_tokens']!s:>5}", flush=True)  # fmt: skip
    result = {
        "benchmark": "speculative",
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "speculative_config": args.speculative_config,
        "machine": cpu_info(),
        "commit": git_commit("engine", "benchmarks"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
