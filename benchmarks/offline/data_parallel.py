"""Data-parallel attention against one rank, on a mixture of experts: the same workload through
`LLM(data_parallel_size=D, expert_parallel_size=D)` (D ranks, each its own requests and 1/D
of the routed experts, exchanged by all-to-all: engine/data_parallel.py) and through one rank
holding every expert, in one run.

    python -m benchmarks.offline.data_parallel              # D = 2, a ~0.2B random Qwen3-MoE
    python -m benchmarks.offline.data_parallel --rounds 3 --dtype float32

On one machine the D ranks share its cores (each gets cores / D threads, as `rank_config`
gives them) while the one rank uses them all: what this measures on a CPU is the exchange's
and the lockstep's cost against splitting the same work by threads, not the memory a GPU
deployment saves. Workload: `--num-prompts` random prompts (uniform lengths), greedy,
ignore_eos, all submitted at once. Rounds alternate the two systems; each reports output
tokens/s and the ratio D ranks / one rank within the round, and the greedy outputs of the two
are compared (equal: the exchange gives one rank's bits). Model: benchmarks/offline/
moe_model.py's builder with smaller shapes (`SHAPES`), built once under --model-dir.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common.machine import cpu_info, git_commit, write_json
from benchmarks.offline.moe_model import MoEShapes, build_moe_dir
from benchmarks.offline.workload import make_workload

SHAPES = MoEShapes(
    hidden_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    vocab_size=8192,
)
"""About 0.2B parameters: 12 sparse layers of 32 experts, top-4."""
DEFAULT_DIR = Path("~/.cache/duet/qwen3-moe-dp-bench").expanduser()


def timed_run(model: str, dtype: str, dp: int, prompts: list[list[int]], outs: list[int]) -> Any:
    """(output tokens/s, token ids per prompt) of one system: load, warm up, time one call."""
    from duet.engine import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(dtype=dtype, load_progress=False, max_num_seqs=len(prompts))
    if dp > 1:
        kwargs.update(data_parallel_size=dp, expert_parallel_size=dp)
    llm = LLM(model, **kwargs)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return sum(outs) / seconds, [r.outputs[0].token_ids for r in results]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", default="32,128", help="min,max tokens")
    p.add_argument("--output-len", default="32,64", help="min,max tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model = str(build_moe_dir(args.model_dir, SHAPES))
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    out_lo, out_hi = (int(x) for x in args.output_len.split(","))
    work = make_workload(args.num_prompts, 0, SHAPES.vocab_size, set(), (lo, hi), (out_lo, out_hi))
    dp = args.data_parallel_size
    runs: dict[int, list[float]] = {1: [], dp: []}
    same = True
    print(
        f"{cpu_info()['cpu_model']}; {SHAPES.num_parameters() / 1e9:.2f}B parameters, {args.dtype}"
    )
    for r in range(args.rounds):
        tokens = {}
        for size in (1, dp) if r % 2 == 0 else (dp, 1):
            tps, tokens[size] = timed_run(model, args.dtype, size, work.prompts, work.max_tokens)
            runs[size].append(tps)
            print(f"round {r + 1} data_parallel_size={size}: {tps:.1f} output tok/s")
        same = same and tokens[1] == tokens[dp]
        print(f"round {r + 1} ratio {dp} ranks / 1 rank: {runs[dp][-1] / runs[1][-1]:.3f}")
    one, many = statistics.median(runs[1]), statistics.median(runs[dp])
    print(f"median: 1 rank {one:.1f}, {dp} ranks {many:.1f} tok/s, ratio {many / one:.3f}; "
          f"greedy tokens {'equal' if same else 'DIFFER'}")  # fmt: skip
    if args.out is not None:
        write_json(args.out, {
            "machine": cpu_info(), "commit": git_commit("engine"), "args": {
                k: str(v) for k, v in vars(args).items()
            }, "shapes": SHAPES.__dict__, "tok_s": {"1": runs[1], str(dp): runs[dp]},
            "ratio_median": many / one, "greedy_equal": same,
        })  # fmt: skip


if __name__ == "__main__":
    main()
