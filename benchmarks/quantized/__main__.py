"""`python -m benchmarks.quantized`: decode speed of bf16, int8 and int4 weights (and llama.cpp
on the matching GGUF when llama-cpp-python is importable); `--accuracy`: mean NLL of a shipped
public-domain text per format. Writes benchmarks/results/quantized[_accuracy].json."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit
from benchmarks.quantized.accuracy import mean_nll, top1_match
from benchmarks.quantized.bandwidth import read_bandwidth_gbs
from benchmarks.quantized.llama_cpp import llama_cpp_available
from benchmarks.quantized.methods import DTYPES, METHODS, applicable
from benchmarks.quantized.speed import greedy_agreement, ratios, run_speed
from duet.engine.gguf_loader import default_model_path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized", description=__doc__)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated formats")
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="speed: activation dtype (float32 where the CPU lacks native bf16)")  # fmt: skip
    parser.add_argument("--accuracy", action="store_true", help="mean NLL instead of speed")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize the LM head too (llama.cpp's Q8_0/Q4_1 files do)")  # fmt: skip
    parser.add_argument("--window", type=int, default=1024, help="accuracy: tokens per window")
    parser.add_argument("--max-text-tokens", type=int, default=None, help="accuracy: cut the text")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="batch size (0: single stream only)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    parser.add_argument("--llama-cpp-q4-1", default=None,
                        help="Q4_1 GGUF for llama.cpp (default: the embedded SmolLM2)")  # fmt: skip
    parser.add_argument("--llama-cpp-q8-0", default=None, help="Q8_0 GGUF for llama.cpp")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--out", type=Path, default=None, help="result JSON path")
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    methods = [m for m in args.methods.split(",") if applicable(m, args.model)]
    if args.threads:
        torch.set_num_threads(args.threads)
    record: dict[str, object] = {"machine": cpu_info(), "commit": git_commit("engine"),
                                 "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
                                 "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if args.accuracy:
        rows = [mean_nll(args.model, m, args.group_size, args.window, args.max_text_tokens,
                         args.quantize_lm_head) for m in methods]  # fmt: skip
        top1_match(rows)
        base = next((r["mean_nll"] for r in rows if r["method"] == "bf16"), None)
        print(f"{'format':8} {'mean NLL':>9} {'vs bf16':>8} {'top-1 = bf16':>13} "
              f"{'weights MiB':>12}  tokens")  # fmt: skip
        for row in rows:
            rel = f"{float(row['mean_nll']) / float(base) - 1:+.2%}" if base else "-"
            match = row.get("top1_match_vs_bf16")
            same = f"{match:.2%}" if match is not None else "-"
            mib = int(row["weight_bytes"]) / 2**20
            print(f"{row['method']:8} {row['mean_nll']:9.4f} {rel:>8} {same:>13} {mib:12.1f}  "
                  f"{row['tokens']}")  # fmt: skip
        record["accuracy"] = rows
        name = "quantized_accuracy.json"
    else:
        files: dict[str, str] = {}
        if not args.no_llama_cpp and llama_cpp_available():
            if args.llama_cpp_q4_1 or args.model is None:
                files["Q4_1"] = args.llama_cpp_q4_1 or default_model_path()
            if args.llama_cpp_q8_0:
                files["Q8_0"] = args.llama_cpp_q8_0
        elif not args.no_llama_cpp:
            print("llama-cpp-python is not importable: no llama.cpp baseline "
                  "(see benchmarks/quantized/llama_cpp.py to install it)")  # fmt: skip
        # NOTE: the limit before and after the decode runs: the machine is shared, and a
        # read rate above the lower one would mean the probe, not the decode, was disturbed.
        limits = [read_bandwidth_gbs()]
        results = run_speed(args.model, methods, args.group_size, files, args.prompt_tokens,
                            args.new_tokens, args.batch, args.rounds, args.threads,
                            lm_head=args.quantize_lm_head, dtype=args.dtype)  # fmt: skip
        limits.append(read_bandwidth_gbs())
        limit = max(limits)
        record["read_bandwidth_gbs"] = limits
        print(f"memory read bandwidth (torch sum over 1 GiB): {limits[0]:.1f} GB/s before, "
              f"{limits[1]:.1f} after")  # fmt: skip
        print(f"{'system':18} {'1-stream tok/s':>15} {'batch tok/s':>12} {'weights MiB':>12} "
              f"{'MB/token':>9} {'GB/s':>6} {'of limit':>9}")  # fmt: skip
        for r in results:
            s = r.summary()
            batch = f"{s['batch_median']:.1f}" if s["batch_median"] else "-"
            mib = f"{r.weight_bytes / 2**20:.1f}" if r.weight_bytes else "-"
            per_token = r.streamed_bytes_per_token
            mb = f"{per_token / 1e6:.1f}" if per_token else "-"
            gbs = s["single_stream_gbs"]
            rate = f"{gbs:.1f}" if gbs else "-"
            share = f"{gbs / limit:.0%}" if gbs else "-"
            print(f"{r.system:18} {s['single_stream_median']:15.1f} {batch:>12} {mib:>12} "
                  f"{mb:>9} {rate:>6} {share:>9}")  # fmt: skip
        record["speed"] = [r.summary() for r in results]
        record["ratios"] = ratios(results)
        for key, value in record["ratios"].items():  # type: ignore[union-attr]
            print(f"{key}: {value:.3f}")
        record["greedy_agreement"] = agreement = greedy_agreement(results)
        for key, a in agreement.items():
            print(f"{key} greedy: {a['prefix_agreement']:.1%} of each output before the first "
                  f"difference, {a['equal_outputs']:.0f} of {a['outputs']:.0f} outputs equal")  # fmt: skip
        name = "quantized.json"
    out = args.out or REPO_ROOT / "benchmarks" / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
