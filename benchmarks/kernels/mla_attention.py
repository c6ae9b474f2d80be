"""CPU attention of a multi-head latent attention model (DeepSeek-V2/V3) over its paged cache of
compressed entries: duet's C++ kernels (the entry read as the one KV head of multi-query
attention, engine/model/latent_attention.py) against the torch reference they replaced, and
the decode step's memory bound.

    python -m benchmarks.kernels.mla_attention                   # V3's 128 heads, bf16
    python -m benchmarks.kernels.mla_attention --heads 16 --contexts 4096 --batch 8

Per context length: a decode step of `--batch` sequences (one query row each) and a prefill of
one `--prefill`-token chunk at the end of a sequence of that length. Both paths get the same
query and cache (random entries, blocks in a shuffled order); their outputs are compared
before timing. Reported: median ms of each, reference / kernel, the kernels' GFLOP/s (2 x
heads x keys seen x (width + latent): the score over the whole entry, the value over the
latent), and the decode step's GB/s (the entries it reads: batch x context x width x bytes)
against the machine's read bandwidth (a torch sum over 1 GiB, in the same run). With many heads
per rank the absorbed form is bound by arithmetic, not by those bytes: V3's 128 heads do 278
kFLOP per entry read. Results: stdout and
benchmarks/results/mla_attention.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import write_record
from benchmarks.kernels.prefill_attention import median_ms
from benchmarks.quantized.bandwidth import read_bandwidth_gbs
from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.cpu import load_cpu_kernels
from duet.engine.model.latent_attention import latent_attention

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "benchmarks/results/mla_attention.json"
LATENT, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim


def _metas(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int
) -> tuple[AttentionMetadata, AttentionMetadata]:
    cpu = torch.device("cpu")
    kernel = AttentionMetadata.build(
        query_lens, seq_lens, tables, block_size, cpu, use_decode_kernel=True
    )
    reference = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, cpu)
    return kernel, reference


def measure(
    context: int, batch: int, prefill: int, heads: int, dtype: torch.dtype, reps: int
) -> dict[str, Any]:
    block_size, width = 16, LATENT + ROPE
    g = torch.Generator().manual_seed(context)
    per_seq = -(-context // block_size)
    pool = batch * per_seq + 8
    cache = torch.randn(1, pool, block_size, 1, width, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    scale = (128 + ROPE) ** -0.5
    row: dict[str, Any] = {"context": context, "batch": batch, "heads": heads}
    cases = {
        "decode": ([1] * batch, [context] * batch, tables),
        "prefill": ([prefill], [context], tables[:1]),
    }
    for name, (query_lens, seq_lens, blocks) in cases.items():
        query = torch.randn(sum(query_lens), heads, width, generator=g).to(dtype)
        kernel, reference = _metas(query_lens, seq_lens, blocks, block_size)
        got = latent_attention(query, cache, kernel, scale, LATENT)
        want = latent_attention(query, cache, reference, scale, LATENT)
        err = (got.float() - want.float()).abs().max().item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), (name, err)
        fast = median_ms(
            lambda k=kernel, q=query: latent_attention(q, cache, k, scale, LATENT), reps
        )
        slow = median_ms(
            lambda r=reference, q=query: latent_attention(q, cache, r, scale, LATENT),
            max(1, reps // 4),
        )
        # multiply-adds per head and key: the score over the entry, the value over the latent
        keys = sum(
            s - q + j + 1 for q, s in zip(query_lens, seq_lens, strict=True) for j in range(q)
        )
        flops = 2 * heads * keys * (width + LATENT)
        row[name] = {
            "kernel_ms": fast,
            "reference_ms": slow,
            "speedup": slow / fast,
            "kernel_gflops": flops / (fast * 1e-3) / 1e9,
        }
    read = batch * context * width * cache.element_size()
    row["decode"]["bytes_read"] = read
    row["decode"]["gbs"] = read / (row["decode"]["kernel_ms"] * 1e-3) / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128, help="query heads on this rank")
    parser.add_argument("--contexts", default="512,2048", help="comma-separated lengths")
    parser.add_argument("--batch", type=int, default=4, help="sequences per decode step")
    parser.add_argument("--prefill", type=int, default=64, help="query tokens of the chunk")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if load_cpu_kernels() is None:
        print("the C++ CPU kernels did not build here")
        return 2
    dtype = getattr(torch, args.dtype)
    bandwidth = read_bandwidth_gbs()
    rows = []
    print(f"read bandwidth {bandwidth:.1f} GB/s; {args.heads} heads, width {LATENT + ROPE}")
    print(
        "context  batch  decode kernel ms  reference ms    x  GFLOP/s  GB/s   "
        "prefill kernel ms  reference ms    x  GFLOP/s"
    )
    for context in (int(c) for c in args.contexts.split(",")):
        r = measure(context, args.batch, args.prefill, args.heads, dtype, args.reps)
        d, p = r["decode"], r["prefill"]
        d["bandwidth_share"] = d["gbs"] / bandwidth
        print(
            f"{context:7d}  {args.batch:5d}  {d['kernel_ms']:16.3f}  {d['reference_ms']:12.1f}"
            f"  {d['speedup']:3.0f}  {d['kernel_gflops']:7.1f}  {d['gbs']:4.1f}"
            f"   {p['kernel_ms']:17.3f}  {p['reference_ms']:12.1f}  {p['speedup']:3.0f}"
            f"  {p['kernel_gflops']:7.1f}"
        )
        rows.append(r)
    results = {"threads": torch.get_num_threads(), "read_bandwidth_gbs": bandwidth, "rows": rows}
    write_record(args.out, "mla_attention", args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
