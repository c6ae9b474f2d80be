"""The decode attention kernel alone, swept over its split count and key tile, against the HBM
bandwidth its K/V reads need: which launch a batch should get (`choose_num_splits`,
`decode_launch_config`), measured rather than guessed.

    python -m benchmarks.kernels.decode_splits [--batches 1,64] [--context 1024] [--smoke]

The GPU benchmark (`benchmarks.kernels.gpu`, and so `make gpu-check`) runs it at Llama-3.1-8B's
attention shape (32 query heads over 8 KV heads of 128, bf16, 16-token blocks, each request's
blocks scattered over the pool as the allocator leaves them). A row: the batch, the launch
(splits, BLOCK_N, num_stages), microseconds per call (the merge kernel's included when it
runs), the K/V GB/s that is, and whether it is the launch the engine chooses today. On the
H200 (2026-11-30) the engine's step spent 13.6 us a layer here at batch 1 and context 1,024
(4 MB of K/V: about 1 us at the copy bandwidth), with 4 splits.

Without CUDA, `--smoke` runs tiny shapes in the Triton interpreter (TRITON_INTERPRET=1) and
checks every launch against the default one; its times mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPLITS = (1, 2, 4, 8, 16)
TILES = ({"BLOCK_N": 32, "num_stages": 2}, {"BLOCK_N": 32, "num_stages": 3},
         {"BLOCK_N": 64, "num_stages": 2}, {"BLOCK_N": 64, "num_stages": 3})  # fmt: skip
"""The first is the engine's in bf16 (`decode_launch_config`)."""
LLAMA_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
BLOCK_SIZE = 16


def _case(
    batch: int, context: int, shape: dict[str, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """A decode batch of `batch` requests of `context` tokens each, their blocks a random
    permutation of the pool (the allocator's order after some churn)."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, shape["num_kv_heads"], shape["head_dim"],
                     generator=gen).to(dtype).to(device)  # fmt: skip
    query = torch.randn(batch, shape["num_heads"], shape["head_dim"], generator=gen)
    order = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    tables = torch.from_numpy(order.reshape(batch, blocks_per_seq)).to(device)
    i32 = {"dtype": torch.int32, "device": device}
    return {
        "kv": kv, "query": query.to(dtype).to(device), "tables": tables,
        "starts": torch.arange(batch + 1, **i32), "lens": torch.full((batch,), context, **i32),
        "decodes": torch.arange(batch, **i32),
        "kv_bytes": batch * context * 2 * shape["num_kv_heads"] * shape["head_dim"] * kv.element_size(),
    }  # fmt: skip


def sweep(
    device: torch.device,
    dtype: torch.dtype,
    batches: tuple[int, ...],
    context: int,
    shape: dict[str, int] = LLAMA_8B,
    splits: tuple[int, ...] = SPLITS,
    tiles: tuple[dict[str, int], ...] = TILES,
    iters: int = 50,
) -> list[dict[str, Any]]:
    """Every (split count, tile) launch at each batch: microseconds per call, K/V GB/s, and
    whether it is the engine's choice. Every launch's output is checked against the engine's
    own (within 2e-2 in 16-bit dtypes, 1e-4 in fp32: the splits' order differs): `ok`, and
    `max_abs_diff`; a launch that fails to compile or run gets its `error` instead of a time
    (the sweep goes on: on a GPU its other rows and the benchmark's are worth keeping)."""
    from benchmarks.kernels.gpu import timed
    from duet.engine.kernels.triton_decode import (
        choose_num_splits,
        decode_launch_config,
        device_num_sms,
        paged_decode_attention,
    )

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rows = []
    for batch in batches:
        case = _case(batch, context, shape, dtype, device)
        chosen = choose_num_splits(batch, shape["num_kv_heads"], context, device_num_sms(device))
        group = shape["num_heads"] // shape["num_kv_heads"]
        engine = decode_launch_config(group, shape["head_dim"], dtype, device)

        def run(out: torch.Tensor, n: int, tile: dict[str, int] | None, c: dict = case) -> None:
            paged_decode_attention(out, c["query"], c["kv"], c["starts"], c["lens"], c["tables"],
                                   c["decodes"], shape["head_dim"] ** -0.5, n, tiles=tile)  # fmt: skip

        want = torch.empty_like(case["query"])
        run(want, chosen, None)
        for n, tile in itertools.product(splits, tiles):
            row: dict[str, Any] = {
                "batch": batch, "context": context, "splits": n, **tile,
                "chosen": n == chosen and all(engine[k] == v for k, v in tile.items()),
            }  # fmt: skip
            out = torch.empty_like(case["query"])
            try:
                run(out, n, tile)
                seconds = timed(lambda out=out, n=n, tile=tile: run(out, n, tile), device, iters)
            except Exception as e:  # reported in the row
                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            err = (out.float() - want.float()).abs().max().item()
            rows.append({**row, "ok": err <= tol, "max_abs_diff": err, "us": seconds * 1e6,
                         "kv_gbs": case["kv_bytes"] / seconds / 1e9})  # fmt: skip
    return rows


def best(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per batch: the fastest launch and the engine's, with their times."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch and r.get("ok")]
        if not mine:
            continue
        fastest = min(mine, key=lambda r: r["us"])
        chosen = next((r for r in mine if r["chosen"]), None)
        out[str(batch)] = {
            "fastest": {k: fastest.get(k) for k in ("splits", "BLOCK_N", "num_stages", "us")},
            "chosen": None if chosen is None else {k: chosen[k] for k in ("splits", "us")},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.decode_splits", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/decode_splits.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreter")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.smoke:
        rows = sweep(torch.device("cpu"), torch.float32, (1, 3), 40,
                     {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}, (1, 2, 4),
                     ({"BLOCK_N": 16}, {"BLOCK_N": 32}), iters=1)  # fmt: skip
    elif not torch.cuda.is_available():
        print("benchmarks.kernels.decode_splits: no CUDA device; --smoke checks the script.")
        return 0
    else:
        rows = sweep(torch.device("cuda"), torch.bfloat16, batches, args.context)
    for r in rows:
        mark = "  <- the engine's" if r["chosen"] else ""
        head = (f"batch {r['batch']:3d} splits {r['splits']:2d} BLOCK_N {r['BLOCK_N']:3d} "
                f"stages {r.get('num_stages', '-')}")  # fmt: skip
        if "error" in r:
            print(f"{head}: {r['error']}")
        else:
            bad = "" if r["ok"] else f"  WRONG: off by {r['max_abs_diff']:.3g}"
            print(f"{head}: {r['us']:8.1f} us {r['kv_gbs']:7.0f} GB/s{mark}{bad}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "best": best(rows)}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
