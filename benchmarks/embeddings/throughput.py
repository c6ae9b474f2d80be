"""Embedding throughput: duet's engine (`SamplingParams.pooling`, what `/v1/embeddings` runs)
against HF transformers, on the same weights, in one run.

    python -m benchmarks.embeddings                       # the embedded SmolLM2-135M, fp32
    python -m benchmarks.embeddings --dtype bfloat16 --inputs 256 --rounds 3

The workload: `--inputs` seeded random-token prompts, lengths uniform in [`--min-len`,
`--max-len`], new ones each round (a round must not read the prefix cache an earlier
round filled: HF has none). duet embeds them in one `LLM.generate` call (its scheduler batches and chunks
them); HF runs the base model (`AutoModel`, no LM head) in padded batches of `--hf-batch`,
sorted by length first as sentence-transformers' `encode` does, pools the last real token of
each row (or the mean over its real tokens) and normalizes. Rounds alternate which side goes
first. Each round checks the two sides agree (the smallest cosine between a prompt's two
vectors, 0.9999 at least in fp32, 0.99 in bf16), so a fast wrong run cannot pass for a result.
Reports inputs/s and prompt tokens/s of each and duet/HF; results in
benchmarks/results/embeddings.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit

RESULTS = REPO_ROOT / "benchmarks" / "results" / "embeddings.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__)
    p.add_argument("--model", default=None, help="HF model directory (default: the embedded "
                   "SmolLM2, exported once to an HF directory)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--pooling", default="last", choices=["last", "mean"])
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for flag in ("inputs", "min_len", "max_len", "hf_batch", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.min_len > args.max_len:
        p.error("--min-len: must be <= --max-len")
    return args


def workload(vocab: int, num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(100, vocab - 100, (n,), generator=gen).tolist() for n in lengths]


def duet_embed(llm: Any, prompts: list[list[int]], pooling: str) -> list[list[float]]:
    from duet.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
    return [o.embedding for o in llm.generate(prompts, params)]


def hf_embed(model: Any, prompts: list[list[int]], pooling: str, batch: int) -> list[Any]:
    """HF's base model over padded batches (sorted by length), pooled and normalized, in the
    prompts' order."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Any] = [None] * len(prompts)
    with torch.inference_mode():
        for lo in range(0, len(order), batch):
            rows = order[lo : lo + batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):  # right padding: positions start at 0 for every row
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if pooling == "last":
                pooled = hidden[torch.arange(len(rows)), mask.sum(dim=1) - 1]
            else:
                pooled = (hidden * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for r, i in enumerate(rows):
                out[i] = pooled[r]
    return out


def run(
    llm: Any,
    model: Any,
    make_prompts: Callable[[int], list[list[int]]],
    pooling: str,
    hf_batch: int,
    rounds: int,
) -> dict[str, Any]:
    """`make_prompts(seed)`: each round's own prompts (seed = the round + 1), so no round
    reads the prefix cache an earlier one filled (HF has none); the warm-up's are seed 0's."""
    import torch

    warm = make_prompts(0)[:2]
    duet_embed(llm, warm, pooling)  # warm-up: buffers, kernels
    hf_embed(model, warm, pooling, hf_batch)
    per_round = []
    for r in range(rounds):
        prompts = make_prompts(r + 1)
        num_tokens = sum(len(p) for p in prompts)
        order = ["duet", "hf"] if r % 2 == 0 else ["hf", "duet"]
        measured: dict[str, Any] = {"order": order, "inputs": len(prompts), "tokens": num_tokens}
        vectors: dict[str, list[Any]] = {}
        for side in order:
            start = time.perf_counter()
            if side == "duet":
                vectors[side] = [torch.tensor(v) for v in duet_embed(llm, prompts, pooling)]
            else:
                vectors[side] = hf_embed(model, prompts, pooling, hf_batch)
            wall_s = time.perf_counter() - start
            measured[side] = {"wall_s": wall_s, "inputs_s": len(prompts) / wall_s,
                              "tok_s": num_tokens / wall_s}  # fmt: skip
        cosines = [float(a @ b) for a, b in zip(vectors["duet"], vectors["hf"], strict=True)]
        measured["min_cosine"] = min(cosines)
        measured["ratio"] = measured["duet"]["inputs_s"] / measured["hf"]["inputs_s"]
        per_round.append(measured)
    return {
        "rounds": per_round,
        "median_ratio": statistics.median(m["ratio"] for m in per_round),
        "min_cosine": min(m["min_cosine"] for m in per_round),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModel

    from duet.engine import LLM

    path = args.model
    if path is None:
        from benchmarks.offline.smollm2_hf import export_hf_dir

        path = str(export_hf_dir())
    dtype = getattr(torch, args.dtype)
    llm = LLM(path, dtype=args.dtype, load_progress=False, max_num_seqs=args.hf_batch)
    model = AutoModel.from_pretrained(path, dtype=dtype).eval()
    vocab = llm.engine.arch.vocab_size

    def make_prompts(seed: int) -> list[list[int]]:
        return workload(vocab, args.inputs, args.min_len, args.max_len, seed)

    result = run(llm, model, make_prompts, args.pooling, args.hf_batch, args.rounds)
    floor = 0.9999 if args.dtype == "float32" else 0.99
    result.update(
        machine=cpu_info(), commit=git_commit("engine", "router"), model=args.model or "default",
        dtype=args.dtype, pooling=args.pooling, hf_batch=args.hf_batch, min_len=args.min_len,
        max_len=args.max_len, threads=torch.get_num_threads(),
    )  # fmt: skip
    for m in result["rounds"]:
        print(
            f"{m['order'][0]} first: duet {m['duet']['inputs_s']:7.1f} inputs/s "
            f"({m['duet']['tok_s']:8.0f} tok/s), HF {m['hf']['inputs_s']:7.1f} inputs/s "
            f"({m['hf']['tok_s']:8.0f} tok/s), duet/HF {m['ratio']:.2f}, "
            f"min cosine {m['min_cosine']:.6f}"
        )
    print(f"duet/HF median over rounds: {result['median_ratio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if result["min_cosine"] < floor:
        print(f"the two sides disagree: min cosine {result['min_cosine']:.6f} < {floor}")
        return 1
    return 0
