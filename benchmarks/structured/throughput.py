"""Decode throughput with and without a JSON-schema constraint, at batch 1 and 32, in one run.

    python -m benchmarks.structured                         # the embedded SmolLM2-135M
    python -m benchmarks.structured --rounds 5 --dtype bfloat16 --batches 1 32

Each round times the same seeded prompts twice with `engine.LLM.generate`, unconstrained and
under `SCHEMA` (the order alternates between rounds, so drift of the machine falls on both),
and reports output tokens/s of each and their ratio; the target is a constrained run at most
10% slower. The constrained replies are checked against the schema, so a fast run that broke
the grammar cannot pass for a result.

Both sides do the same work: a calibration pass (untimed) runs the constrained requests once
and records how many tokens each row generated (its JSON ends, or `max_tokens` cuts it); the
unconstrained request of that row then uses `ignore_eos` with exactly that `max_tokens`. So at
every step both sides decode the same number of rows, and the ratio measures the grammar's
cost alone, not a batch that shrinks on one side only (seeded sampling keeps each row's length
the same in every round; the run checks it). The grammar is compiled once before timing (its
first compile is reported on its own: `compile_s`). Results: benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit

RESULTS = REPO_ROOT / "benchmarks" / "results" / "structured.json"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["person", "place", "thing", "event"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 2, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 32},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"], "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "tags", "address", "active"],
    "additionalProperties": False,
}  # fmt: skip
"""Enums, bounded numbers, bounded strings, a pattern, an array and a nested object."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__)
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for flag in ("max_tokens", "prompt_len", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1")
    if any(b < 1 for b in args.batches):
        p.error("--batches: every batch must be >= 1")
    return args


def _timed(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, int, list[str]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outs]
    return wall_s, sum(len(o.outputs[0].token_ids) for o in outs), texts


def _row_lengths(llm: Any, prompts: list[list[int]], params: Any) -> list[int]:
    """How many tokens each prompt's constrained reply has (seeded: the same every round)."""
    return [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def run(
    llm: Any,
    batches: list[int],
    max_tokens: int,
    prompt_len: int,
    rounds: int,
    schema: dict[str, Any] = SCHEMA,
) -> dict[str, Any]:
    """Measure; every constrained reply is validated against `schema` (`num_valid`: those that
    finished within max_tokens)."""
    import torch

    from duet.engine import SamplingParams, StructuredOutputsParams

    spec = StructuredOutputsParams(json=schema)  # type: ignore[arg-type]  # serialized
    start = time.perf_counter()
    llm.engine.grammar_compiler.compile(spec)
    compile_s = time.perf_counter() - start
    vocab = llm.engine.arch.vocab_size
    cells = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [
            torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]
        constrained = SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=1, structured_outputs=spec
        )
        free = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
        for sp in (free, constrained):  # warm-up: buffers, kernels, the grammar, both paths
            _timed(llm, prompts[:1], dataclasses.replace(sp, max_tokens=8))
        lengths = _row_lengths(llm, prompts, constrained)  # the calibration pass
        params: dict[str, Any] = {
            "json": [constrained] * batch,
            "free": [dataclasses.replace(free, max_tokens=n) for n in lengths],
        }
        per_round = []
        for r in range(rounds):
            order = ["free", "json"] if r % 2 == 0 else ["json", "free"]
            measured: dict[str, Any] = {"order": order}
            for kind in order:
                wall_s, num_tokens, texts = _timed(llm, prompts, params[kind])
                if num_tokens != sum(lengths):
                    raise RuntimeError(
                        f"batch {batch}, {kind}: {num_tokens} tokens, the calibration pass "
                        f"gave {sum(lengths)}; the two sides would not do the same work"
                    )
                measured[kind] = {"wall_s": wall_s, "tokens": num_tokens,
                                  "tok_s": num_tokens / wall_s}  # fmt: skip
                if kind == "json":
                    num_valid = 0
                    for text in texts:
                        try:
                            jsonschema.validate(json.loads(text), schema)
                            num_valid += 1
                        except ValueError:
                            pass  # cut by max_tokens: an unfinished prefix
                    measured[kind]["num_valid"] = num_valid
            measured["ratio"] = measured["json"]["tok_s"] / measured["free"]["tok_s"]
            per_round.append(measured)
        ratios = [m["ratio"] for m in per_round]
        cells.append({"batch": batch, "rounds": per_round, "row_tokens": lengths,
                      "median_ratio": statistics.median(ratios)})  # fmt: skip
    return {"compile_s": compile_s, "cells": cells}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from duet.engine import LLM

    kwargs: dict[str, Any] = {"dtype": args.dtype, "load_progress": False,
                              "max_num_seqs": max(args.batches)}  # fmt: skip
    llm = LLM(args.model, **kwargs)  # None: the embedded default model
    result = run(llm, args.batches, args.max_tokens, args.prompt_len, args.rounds)
    result.update(
        machine=cpu_info(), commit=git_commit("engine", "router"), model=args.model or "default",
        dtype=args.dtype, max_tokens=args.max_tokens, prompt_len=args.prompt_len,
    )  # fmt: skip
    print(f"grammar compile: {result['compile_s'] * 1000:.0f} ms")
    for cell in result["cells"]:
        last = cell["rounds"][-1]
        print(
            f"batch {cell['batch']:>3}: free {last['free']['tok_s']:8.1f} tok/s, "
            f"json {last['json']['tok_s']:8.1f} tok/s ({last['json']['num_valid']}/"
            f"{cell['batch']} valid), json/free median over rounds {cell['median_ratio']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0
