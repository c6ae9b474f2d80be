"""GPU benchmark of duet's engine on random weights shaped like Llama-3.1-8B and SmolLM2-135M
(bf16): decode step time against the memory roofline, prefill against the bf16 matmul peak,
and HF transformers on the same GPU, model and weights as the baseline, all in one run.

    python -m benchmarks.kernels.gpu [--models llama8b,smollm2] [--out benchmarks/results/gpu.json]

- Roofline of a decode step: (weight bytes + KV bytes read) / the copy bandwidth measured in
  this run (device-to-device copy, read + write bytes).
- Prefill: FLOP/s of one prompt (2 x matmul parameters x tokens, plus causal attention)
  against a measured 8192^3 bf16 matmul.
- Decode is timed both eager (prebuilt metadata) and as the CUDA-graph replay the engine runs
  (input staging included); HF's step time is the median time between consecutive steps of
  one `generate` of 1 + K tokens (`hf_step_s`).
- On CUDA, at Llama-8B's shape, the decode attention kernel alone over its split counts and
  key tiles (`decode_splits.py`): the fastest launch per batch against the engine's.

Without CUDA it says so and exits 0. `--smoke` runs tiny shapes on the CPU to check that the
script itself works; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.kernels.gpu_profile import print_profile, profile_step, summarise
from benchmarks.kernels.hf_step import hf_step_s

MODELS: dict[str, dict[str, Any]] = {
    "llama8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "smollm2": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "tiny": dict(  # --smoke only
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=False,
    ),
}  # fmt: skip
BLOCK_SIZE = 16


class Settings:
    def __init__(self, smoke: bool, quick: bool = False) -> None:
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.batches = [1, 4] if smoke else [1, 8, 32, 64, 128]
        self.context = 64 if smoke else 1024
        self.prefill_lens = [64] if smoke else [512, 2048, 8192]
        self.hf_steps = 16
        self.iters = 3 if smoke else 20
        self.copy_bytes = (16 if smoke else 1024) << 20
        self.matmul_n = 512 if smoke else 8192
        self.deterministic = False  # --deterministic
        self.triton = self.device.type == "cuda"  # prefill's attention in the Triton kernels
        self.profile = False  # --profile: each decode step's kernels by kind (gpu_profile.py)
        # Steps that are not decode-only (`mixed_bench`): (prefill chunk tokens, decodes,
        # query tokens per decode), e.g. a chunk beside 64 decodes; 16 speculative requests
        # verifying 3 guesses each.
        self.mixed = [(16, 4, 1), (0, 4, 3)] if smoke else [(256, 64, 1), (0, 16, 4), (0, 64, 4)]
        if quick and not smoke:  # --quick (make gpu-check --quick): the shapes the issue targets
            self.batches, self.prefill_lens, self.iters, self.hf_steps = [1, 64], [2048], 10, 8
            self.mixed = [(256, 64, 1), (0, 16, 4)]


def timed(
    fn: Callable[[], Any],
    device: torch.device,
    iters: int,
    warmup: int = 2,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> float:
    """Seconds per call: the median of `iters` calls (or another `reduce` of them)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return reduce(times)


def host_seconds(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """The median host time of `fn` alone, the device idle at each call's start: what a
    CUDA-graph step spends staging its inputs and launching (the device waits for it, since
    a step's inputs depend on the previous step's tokens)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def measure_device(s: Settings) -> dict[str, float]:
    src = torch.empty(s.copy_bytes, dtype=torch.uint8, device=s.device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), s.device, s.iters)
    n = s.matmul_n
    a = torch.randn(n, n, device=s.device, dtype=s.dtype)
    b = torch.randn(n, n, device=s.device, dtype=s.dtype)
    mm_s = timed(lambda: a @ b, s.device, s.iters)
    return {
        "copy_bandwidth_gbs": 2 * s.copy_bytes / copy_s / 1e9,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
    }


def build_models(spec: dict[str, Any], s: Settings) -> tuple[Any, Any]:
    """HF model with random weights, and duet's model holding a copy of the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from duet.engine.model import LlamaForCausalLM
    from duet.engine.model.arch import ModelArchConfig

    spec = dict(spec)
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(s.device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=s.dtype).eval()
    arch = ModelArchConfig.from_hf_config(hf_config.to_dict())
    with torch.device("meta"):
        duet = LlamaForCausalLM(arch)
    duet = duet.to(s.dtype).to_empty(device=s.device)  # cast on meta: no fp32 copy
    duet.rotary.rebuild(s.device)
    duet.load_weights(hf.state_dict().items())
    if s.deterministic and s.device.type == "cuda":  # what the loader sets (engine/loader.py)
        from duet.engine.model import row_invariant
        from duet.engine.model.llama import RMSNorm

        row_invariant.use_invariant_gemm(duet)
        for module in duet.modules():
            if isinstance(module, RMSNorm):
                module.invariant = True
    return hf, duet.eval()


def decode_bench(duet: Any, s: Settings) -> list[dict[str, Any]]:
    from duet.engine.attention_metadata import AttentionMetadata
    from duet.engine.cuda_graphs import DecodeGraphs

    cfg = duet.config
    ctx, bs = s.context, BLOCK_SIZE
    blocks_per_seq = -(-(ctx + 1) // bs)
    num_blocks = max(s.batches) * blocks_per_seq
    caches = [
        torch.randn(2, num_blocks, bs, duet.num_kv_heads, cfg.head_dim, device=s.device).to(s.dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    graphs = None
    if s.device.type == "cuda":
        graphs = DecodeGraphs(
            duet, caches, max(s.batches), ctx + bs, bs, deterministic=s.deterministic
        )
    itemsize = torch.empty((), dtype=s.dtype).element_size()
    weight_bytes = sum(p.numel() for p in duet.parameters()) * itemsize
    if not cfg.tie_word_embeddings:  # the embedding is looked up, not read whole
        weight_bytes -= duet.embed_tokens.weight.numel() * itemsize
    rows = []
    rng = np.random.default_rng(0)
    for batch in s.batches:
        block_ids = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)
        ]
        seq_lens = [ctx] * batch
        ids_np = rng.integers(0, cfg.vocab_size, batch, dtype=np.int64)
        pos_np = np.full(batch, ctx - 1, dtype=np.int64)
        slots_np = np.array([b[(ctx - 1) // bs] * bs + (ctx - 1) % bs for b in block_ids])
        use_triton = s.device.type == "cuda"
        meta = AttentionMetadata.build(
            [1] * batch, seq_lens, block_ids, bs, s.device,
            triton_num_kv_heads=duet.num_kv_heads if use_triton else None,
            deterministic=s.deterministic,
        )  # fmt: skip
        ids = torch.from_numpy(ids_np).to(s.device)
        pos = torch.from_numpy(pos_np).to(s.device)

        def eager(ids: torch.Tensor = ids, pos: torch.Tensor = pos, meta: Any = meta) -> None:
            duet.compute_logits(duet(ids, pos, caches, meta))

        with torch.inference_mode():
            eager_s = timed(eager, s.device, s.iters)
            graph_s = graph_host_s = None
            if graphs is not None:
                run = functools.partial(graphs.run, ids_np, pos_np, slots_np, seq_lens, block_ids)
                graph_s = timed(lambda run=run: duet.compute_logits(run()), s.device, s.iters)
                graph_host_s = host_seconds(run, s.device, s.iters)
            profiles = None
            if s.profile:
                profiles = {"eager": profile_step(eager, s.device, s.iters)}
                if graphs is not None:
                    profiles["graph"] = profile_step(
                        lambda run=run: duet.compute_logits(run()), s.device, s.iters
                    )
        kv_bytes = (
            batch * ctx * cfg.num_hidden_layers * 2 * duet.num_kv_heads * cfg.head_dim * itemsize
        )
        rows.append(
            {"batch": batch, "context": ctx, "eager_ms": eager_s * 1e3,
             "graph_ms": None if graph_s is None else graph_s * 1e3,
             "graph_host_ms": None if graph_host_s is None else graph_host_s * 1e3,
             "weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
        )  # fmt: skip
        if profiles is not None:
            rows[-1]["profile"] = profiles
    return rows


def mixed_bench(duet: Any, s: Settings) -> list[dict[str, Any]]:
    """Steps that are not decode-only, eager and in piecewise CUDA graphs
    (engine/piecewise_graphs.py, `cuda_graph_mode` piecewise): for each (chunk, decodes,
    query) of `s.mixed`, one request's first `chunk` prompt tokens beside `decodes` requests
    at context `s.context` with `query` tokens each (a decode, or a token and its guesses),
    with the logits of every sampling row. The pieces are captured at the step's size only."""
    return [mixed_step(duet, s, *case) for case in s.mixed]


def mixed_step(duet: Any, s: Settings, chunk: int, decodes: int, query: int) -> dict[str, Any]:
    """One case of `mixed_bench`."""
    from duet.engine.attention_metadata import AttentionMetadata
    from duet.engine.cuda_graphs import EagerCapture
    from duet.engine.piecewise_graphs import PiecewiseGraphs

    cfg, bs, ctx = duet.config, BLOCK_SIZE, s.context
    query_lens = ([chunk] if chunk else []) + [query] * decodes
    seq_lens = ([chunk] if chunk else []) + [ctx] * decodes
    starts = np.cumsum([0, *(-(-n // bs) for n in seq_lens)])
    block_ids = [list(range(a, b)) for a, b in itertools.pairwise(starts.tolist())]
    caches = [
        torch.randn(2, int(starts[-1]), bs, duet.num_kv_heads, cfg.head_dim,
                    device=s.device).to(s.dtype)
        for _ in range(cfg.num_hidden_layers)
    ]  # fmt: skip
    num_tokens = sum(query_lens)
    meta = AttentionMetadata.build(
        query_lens, seq_lens, block_ids, bs, s.device,
        triton_num_kv_heads=duet.num_kv_heads if s.device.type == "cuda" else None,
        deterministic=s.deterministic,
    )  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=s.device)
    positions = [torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens, strict=True)]
    pos = torch.cat(positions).to(s.device)
    sampled = torch.tensor(  # every decode's rows, the chunk's last
        ([chunk - 1] if chunk else []) + list(range(chunk, num_tokens)), device=s.device
    )

    def eager() -> torch.Tensor:
        return duet.compute_logits(duet(ids, pos, caches, meta)[sampled])

    row: dict[str, Any] = {
        "chunk": chunk, "decodes": decodes, "query": query, "tokens": num_tokens, "context": ctx,
    }  # fmt: skip
    with torch.inference_mode():
        row["eager_ms"] = 1e3 * timed(eager, s.device, s.iters)
        # --smoke: the pieces' bookkeeping through a capture that replays by calling
        capture = None if s.device.type == "cuda" else EagerCapture()
        started = time.perf_counter()
        pieces = PiecewiseGraphs(duet, caches, num_tokens, capture, sizes=[num_tokens])
        row["capture_s"] = time.perf_counter() - started

        def in_pieces() -> torch.Tensor:
            return duet.compute_logits(pieces.run(ids, pos, meta)[sampled])

        row["piecewise_ms"] = 1e3 * timed(in_pieces, s.device, s.iters)
        row["speedup"] = row["eager_ms"] / row["piecewise_ms"]
        # how far from the eager step's logits (the engine's tests check tokens bit for bit)
        row["max_abs_logit_diff"] = float((eager() - in_pieces()).abs().max())
    return row


def prefill_bench(duet: Any, s: Settings) -> list[dict[str, Any]]:
    from duet.engine.attention_metadata import AttentionMetadata

    cfg = duet.config
    rows = []
    linear_params = sum(
        m.weight.numel() for name, m in duet.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("layers.")
    )  # fmt: skip
    for n in s.prefill_lens:
        nb = -(-n // BLOCK_SIZE)
        caches = [
            torch.zeros(2, nb, BLOCK_SIZE, duet.num_kv_heads, cfg.head_dim, device=s.device, dtype=s.dtype)
            for _ in range(cfg.num_hidden_layers)
        ]  # fmt: skip
        ids = torch.randint(0, cfg.vocab_size, (n,), device=s.device)
        pos = torch.arange(n, device=s.device)
        attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n
        flops = 2 * linear_params * n + attn  # causal attention: half of 2 x 2 x N^2 x D per head
        row: dict[str, Any] = {"tokens": n, "flops": flops}
        # The prefill kernel, then (on CUDA, not deterministic) the same prompt's attention
        # in torch's SDPA (`--prefill-attention sdpa`): which is faster decides the default.
        triton = s.triton
        kinds = ["triton", "sdpa"] if triton and not s.deterministic else ["triton"]
        logits = {}
        for kind in kinds:
            meta = AttentionMetadata.build(
                [n], [n], [list(range(nb))], BLOCK_SIZE, s.device,
                triton_num_kv_heads=duet.num_kv_heads if triton else None,
                deterministic=s.deterministic, prefill_attention=kind,
            )  # fmt: skip
            forward = functools.partial(duet, ids, pos, caches, meta)
            with torch.inference_mode():
                logits[kind] = duet.compute_logits(forward()[-1:]).float()
                sec = timed(
                    lambda f=forward: duet.compute_logits(f()[-1:]), s.device, max(3, s.iters // 4)
                )
            key = "" if kind == "triton" else "sdpa_"
            row.update({f"{key}ms": sec * 1e3, f"{key}tflops": flops / sec / 1e12})
        if "sdpa" in logits:
            row["sdpa_max_abs_logit_diff"] = float((logits["sdpa"] - logits["triton"]).abs().max())
        rows.append(row)
    return rows


def hf_bench(hf: Any, s: Settings) -> dict[str, Any]:
    vocab = hf.config.vocab_size
    decode, prefill = [], []
    with torch.inference_mode():
        for batch in s.batches:
            ids = torch.randint(0, vocab, (batch, s.context - 1), device=s.device)
            mask = torch.ones_like(ids)
            hf_step_s(hf, ids, mask, 2)  # warm-up
            step = min(hf_step_s(hf, ids, mask, s.hf_steps) for _ in range(2))
            decode.append({"batch": batch, "step_ms": step * 1e3})
        for n in s.prefill_lens:
            ids = torch.randint(0, vocab, (1, n), device=s.device)
            sec = timed(lambda ids=ids: hf(ids, use_cache=False, logits_to_keep=1), s.device, 3)
            prefill.append({"tokens": n, "ms": sec * 1e3})
    return {"decode": decode, "prefill": prefill}


def bench_model(
    name: str, s: Settings, device_stats: dict[str, float], save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """duet's decode and prefill at `name`'s shapes against the roofline and the matmul peak,
    then HF's. `save(partial)` gets duet's rows before HF runs (a caller cut off by a time
    limit keeps them)."""
    hf, duet = build_models(MODELS[name], s)
    decode = decode_bench(duet, s)
    mixed = mixed_bench(duet, s)
    prefill = prefill_bench(duet, s)
    del duet
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    bw = device_stats["copy_bandwidth_gbs"] * 1e9
    for row in decode:
        row["roofline_ms"] = (row["weight_bytes"] + row["kv_bytes"]) / bw * 1e3
        row["roofline_fraction"] = row["roofline_ms"] / (row["graph_ms"] or row["eager_ms"])
        for mode, prof in row.get("profile", {}).items():
            step_ms = row[f"{mode}_ms"]
            row["profile"][mode] = summarise(prof, step_ms, row["weight_bytes"], bw / 1e9)
    for row in prefill:
        for key in ("", "sdpa_"):
            if f"{key}tflops" in row:
                row[f"{key}peak_fraction"] = row[f"{key}tflops"] / device_stats["matmul_tflops"]
    save({"decode": decode, "mixed": mixed, "prefill": prefill,
          "hf_baseline": "not measured (yet)"})  # fmt: skip
    attention = None
    if s.device.type == "cuda" and name == "llama8b":  # the decode kernel's launches, alone
        from benchmarks.kernels.decode_splits import best, sweep

        try:
            rows = sweep(s.device, s.dtype, tuple(s.batches), s.context, iters=s.iters)
            attention = {"rows": rows, "best": best(rows)}
        except Exception as e:  # a benchmark's report: the rest stands
            attention = {"error": f"{type(e).__name__}: {e}"[:1000]}
        save({"decode": decode, "mixed": mixed, "prefill": prefill,
              "decode_attention": attention, "hf_baseline": "not measured (yet)"})  # fmt: skip
    baseline = hf_bench(hf, s)
    del hf
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    for row, hf_row in zip(decode, baseline["decode"], strict=True):
        row["hf_step_ms"] = hf_row["step_ms"]
        row["speedup_vs_hf"] = hf_row["step_ms"] / (row["graph_ms"] or row["eager_ms"])
    for row, hf_row in zip(prefill, baseline["prefill"], strict=True):
        row["hf_ms"] = hf_row["ms"]
        row["speedup_vs_hf"] = hf_row["ms"] / row["ms"]
    return {"decode": decode, "mixed": mixed, "prefill": prefill, "decode_attention": attention}


def print_report(results: dict[str, Any]) -> None:
    print(f"device: {results['device']}  copy {results['copy_bandwidth_gbs']:.0f} GB/s, "
          f"bf16 matmul {results['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip
    for name, r in results["models"].items():
        print(f"\n{name} decode (context {r['decode'][0]['context']}):")
        print("  batch  eager ms  graph ms (host)  roofline ms  of roofline  HF ms  vs HF")
        for d in r["decode"]:
            graph = "-" if d["graph_ms"] is None else f"{d['graph_ms']:.2f}"
            host = "" if d.get("graph_host_ms") is None else f"({d['graph_host_ms']:.2f})"
            print(f"  {d['batch']:5d}  {d['eager_ms']:8.2f}  {graph:>8} {host:>6}"
                  f"  {d['roofline_ms']:11.2f}  {d['roofline_fraction']:10.0%}"
                  f"  {d['hf_step_ms']:5.1f}  {d['speedup_vs_hf']:4.1f}x")  # fmt: skip
        print_profile(name, [d for d in r["decode"] if "profile" in d])
        print(f"{name} steps that are not decode-only (eager, and in piecewise CUDA graphs):")
        print("  chunk  decodes x query  tokens  eager ms  piecewise ms  speed-up  logit diff")
        for m in r.get("mixed", []):
            print(f"  {m['chunk']:5d}  {m['decodes']:7d} x {m['query']:<5d}  {m['tokens']:6d}"
                  f"  {m['eager_ms']:8.2f}  {m['piecewise_ms']:12.2f}  {m['speedup']:7.2f}x"
                  f"  {m['max_abs_logit_diff']:.3g}")  # fmt: skip
        if (r.get("decode_attention") or {}).get("best"):
            print(f"{name} decode attention alone, fastest launch against the engine's:")
            for batch, b in r["decode_attention"]["best"].items():
                f, c = b["fastest"], b["chosen"]
                print(f"  batch {batch}: {f['us']:.1f} us ({f['splits']} splits, BLOCK_N "
                      f"{f['BLOCK_N']}, {f['num_stages']} stages); engine's {c['us']:.1f} us "
                      f"({c['splits']} splits)")  # fmt: skip
        print(f"{name} prefill:")
        print("  tokens  ms  TFLOP/s  of peak  HF ms  vs HF  | attention in SDPA: ms  of peak")
        for p in r["prefill"]:
            sdpa = (
                f"  | {p['sdpa_ms']:.1f}  {p['sdpa_peak_fraction']:.0%}"
                f" (logit diff {p['sdpa_max_abs_logit_diff']:.3g})"
                if "sdpa_ms" in p
                else ""
            )
            print(f"  {p['tokens']:6d}  {p['ms']:.1f}  {p['tflops']:.1f}  {p['peak_fraction']:.0%}"
                  f"  {p['hf_ms']:.1f}  {p['speedup_vs_hf']:.1f}x{sdpa}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.gpu", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--models", default="llama8b,smollm2", help="comma-separated: llama8b, smollm2"
    )
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU: checks the script only"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="decode batches 1 and 64, one 2048-token prefill, fewer iterations",
    )  # fmt: skip
    parser.add_argument(
        "--deterministic", action="store_true",
        help="duet in deterministic mode: Triton matmuls and norms, one attention order",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="profile each decode step: device time by kind of kernel (gpu_profile.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in ("llama8b", "smollm2")]
    if unknown or not names:
        parser.error(
            f"--models: unknown {unknown[0] if unknown else ''!r}; choose from llama8b, smollm2"
        )
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.kernels.gpu: no CUDA device on this machine, nothing measured. "
              "Run it on a GPU machine (H100/H200 class); --smoke checks the script on the CPU.")  # fmt: skip
        return 0
    if args.smoke:
        names = ["tiny"]
    s = Settings(args.smoke, args.quick)
    s.deterministic = args.deterministic
    s.profile = args.profile
    import triton

    stats = measure_device(s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu (smoke)",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(s.dtype).removeprefix("torch."),
        "deterministic": s.deterministic,
        **stats,
        "models": {},
    }

    def save(name: str, partial: dict[str, Any]) -> None:
        out.write_text(json.dumps({**results, "models": {**results["models"], name: partial}},
                                  indent=2) + "\n")  # fmt: skip

    for name in names:
        results["models"][name] = bench_model(name, s, stats, functools.partial(save, name))
    print_report(results)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
