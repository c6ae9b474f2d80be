"""GPU benchmark of the quantized Triton linears (engine/quant/triton_linear.py) against cuBLAS
bf16 on the same GPU, in one run.

    python -m benchmarks.quantized.gpu [--sweep] [--out benchmarks/results/quantized_gpu.json]

1. Kernels: each Llama-3.1-8B projection shape at 1, 16, 64, 256 and 2,048 rows: bf16
   `F.linear` (cuBLAS, the baseline), W8A16 per channel, W8A16 in groups of 32 (GGUF Q8_0),
   W4A16 in groups of 32 (Q4_1-like) and of 128, asymmetric. Each timing is a CUDA graph of
   calls on copies of the weight that together overflow the L2 four times (no launch overhead,
   no weight cached: as a decode step runs them), the median of 10 replays; reported as weight
   GB/s, the fraction of the copy bandwidth measured in this run, and the speed-up over bf16.
   Over 128 rows the wrappers dequantize the weight and call cuBLAS.
2. `--sweep`: tile configurations at 1 and 64 rows for int8 and int4, timed the same way: the
   best against the shipped `launch_config`, to tune it.
3. A decode step of the whole Llama-3.1-8B-shaped model (random weights, context 1,024, CUDA
   graph) in bf16, int8, int4 g32 and int4 g128 at batch 1, 16 and 64, against the memory
   roofline of its weight and KV bytes.

Without CUDA it says so and exits 0. `--smoke` runs tiny shapes on the CPU (the kernels in
Triton's interpreter) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels import gpu as dense_bench
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.formats import Int8Weight, QuantizedWeight, quantize_int4, quantize_int8

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_LAYERS = {"o": (64, 128)}
FORMATS = ("int8", "int8-g32", "int4-g32", "int4-g128")
SWEEP_FORMATS = ("int8", "int4-g32", "int4-g128")


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    if fmt == "int8":
        return quantize_int8(weight)
    if fmt == "int8-g32":
        return quantize_int8(weight, 32)
    return quantize_int4(weight, int(fmt.removeprefix("int4-g")), False)


def product(
    w: QuantizedWeight, dtype: torch.dtype, config: Any = None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """(x -> x @ w.T on the Triton kernel, the bytes it reads of the weight and its scales);
    each call holds its own copy of the weight's tensors."""
    from duet.engine.quant.triton_linear import pack_int4_rows, w4a16_linear, w8a16_linear

    if isinstance(w, Int8Weight):
        q, scale = w.q.clone(), w.scale.to(dtype)
        return (lambda x: w8a16_linear(x, q, scale, config=config)), q.nbytes + scale.nbytes
    zero = (-8 * w.scale if w.offset is None else w.offset).to(dtype)
    packed, scale = pack_int4_rows(w.q), w.scale.to(dtype)
    nbytes = packed.nbytes + scale.nbytes + zero.nbytes
    return (lambda x: w4a16_linear(x, packed, scale, zero, config=config)), nbytes


def copies_for(nbytes: int, device: torch.device) -> int:
    """Weight copies to cycle through so that the L2 holds none of them when its turn comes
    back (four L2s' worth), as in a decode step where every layer reads its own weights."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, min(32, -(-4 * l2 // nbytes)))


def per_call_ms(calls: list[Callable[[], Any]], device: torch.device, smoke: bool) -> float:
    """Milliseconds per call: `calls` captured back to back in one CUDA graph (no launch
    overhead, as the engine's decode graphs run them), the median of 10 replays."""
    if device.type != "cuda" or smoke:
        for call in calls:
            call()
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / len(calls)
    for _ in range(2):  # compiles, and warms the allocator outside the capture
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    del graph
    return statistics.median(times) / len(calls)


def kernel_table(
    device: torch.device, dtype: torch.dtype, layers: dict[str, tuple[int, int]],
    rows_list: list[int], bandwidth: float, smoke: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    out = []
    gen = torch.Generator(device=device).manual_seed(0)
    for layer, (n, k) in layers.items():
        weight = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
        dense = [weight.clone() for _ in range(copies_for(weight.nbytes, device))]
        prepared = {}
        for fmt in FORMATS:
            w = quantize(weight, fmt)
            first = product(w, dtype)
            copies = copies_for(first[1], device)
            prepared[fmt] = [first] + [product(w, dtype) for _ in range(copies - 1)]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
            calls = [lambda x=x, w=w: F.linear(x, w) for w in dense]
            dense_ms = per_call_ms(calls, device, smoke)
            row: dict[str, Any] = {"layer": layer, "n": n, "k": k, "rows": rows,
                                   "bf16_ms": dense_ms, "bf16_bytes": weight.nbytes}  # fmt: skip
            for fmt, fns in prepared.items():
                nbytes = fns[0][1]
                ms = per_call_ms([lambda fn=fn, x=x: fn(x) for fn, _ in fns], device, smoke)
                row[fmt] = {"ms": ms, "bytes": nbytes, "gbs": nbytes / ms / 1e6,
                            "of_bandwidth": nbytes / ms / 1e6 / bandwidth,
                            "vs_bf16": dense_ms / ms, "copies": len(fns)}  # fmt: skip
            out.append(row)
    return out


def sweep_configs(rows: int, smoke: bool) -> Iterator[Any]:
    from duet.engine.quant.triton_linear import LaunchConfig

    if smoke:
        yield from (LaunchConfig(16, 16, 32, s) for s in (1, 2))
        return
    if rows <= 16:
        grid = itertools.product([16], [32, 64, 128], [128, 256], [1, 2, 4, 8], [4], [3, 4])
    else:
        grid = itertools.product([32, 64], [32, 64, 128], [64, 128], [1, 2, 4], [4], [3, 4])
    for bm, bn, bk, split, warps, stages in grid:
        yield LaunchConfig(bm, bn, bk, split, warps, stages)


def sweep(
    device: torch.device, dtype: torch.dtype, layers: dict[str, tuple[int, int]], smoke: bool,
    budget_s: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Best tile configuration per (layer, rows, format) against the shipped one, timed as
    `per_call_ms`; stops adding cases after `budget_s` seconds (the result says what it
    covered)."""
    from duet.engine.quant.triton_linear import _sm_count, launch_config

    start, out = time.monotonic(), []
    gen = torch.Generator(device=device).manual_seed(1)
    for rows, (layer, (n, k)), fmt in itertools.product(
        [1, 64] if not smoke else [1], layers.items(), SWEEP_FORMATS
    ):
        if time.monotonic() - start > budget_s:
            break
        w = quantize((torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype), fmt)
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        copies = copies_for(product(w, dtype)[1], device)

        def time_config(
            cfg: Any, w: QuantizedWeight = w, x: torch.Tensor = x, copies: int = copies
        ) -> float:
            fns = [product(w, dtype, cfg)[0] for _ in range(copies)]
            return per_call_ms([lambda fn=fn: fn(x) for fn in fns], device, smoke)

        shipped = launch_config(rows, n, k, fmt.startswith("int4"), dtype, _sm_count(device))
        shipped_ms = time_config(shipped)
        best: tuple[float, Any] = (shipped_ms, shipped)
        for cfg in sweep_configs(rows, smoke):
            try:
                ms = time_config(cfg)
            except Exception as exc:  # out of shared memory, a dot shape under the minimum
                print(f"  skip {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            best = min(best, (ms, cfg), key=lambda t: t[0])
        case = {"rows": rows, "layer": layer, "format": fmt, "shipped": shipped.__dict__,
                "shipped_ms": shipped_ms, "best": best[1].__dict__, "best_ms": best[0],
                "shipped_over_best": shipped_ms / best[0]}  # fmt: skip
        print(f"sweep {fmt:9s} {layer:7s} rows {rows:4d}: shipped {shipped_ms:.4f} ms, "
              f"best {best[0]:.4f} ms {best[1]}")  # fmt: skip
        out.append(case)
    return out


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter and quantized buffer, less
    the embedding table when the head has its own weight (a lookup reads a few rows)."""
    from duet.engine.model.quantized_linear import QuantizedLinear

    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and getattr(model, "lm_head", None) is not None:
            continue
        total += p.nbytes
    return total


def build_model(spec: dict[str, Any], quant: QuantizationConfig | None, s: Any) -> Any:
    """duet's model with random weights (N(0, 0.02), norms 1), quantized at load like a
    checkpoint with `--quantization`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from duet.engine.model import LlamaForCausalLM
    from duet.engine.model.arch import ModelArchConfig

    spec = dict(spec)
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        shapes = {
            k: v.shape for k, v in AutoModelForCausalLM.from_config(hf_config).state_dict().items()
        }
        model = LlamaForCausalLM(ModelArchConfig.from_hf_config(hf_config.to_dict()), quant=quant)
    model = model.to_empty(device=s.device).to(s.dtype)
    model.rotary.rebuild(s.device)
    gen = torch.Generator(device=s.device).manual_seed(0)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, device=s.device, dtype=s.dtype)
            else:
                t = torch.randn(shape, generator=gen, device=s.device, dtype=torch.float32)
                yield name, (t * 0.02).to(s.dtype)

    model.load_weights(weights())
    return model.eval()


def model_decode(name: str, s: Any, bandwidth: float) -> dict[str, Any]:
    variants = {"bf16": None, "int8": QuantizationConfig("int8"),
                "int4-g32": QuantizationConfig("int4", 32),
                "int4-g128": QuantizationConfig("int4", 128)}  # fmt: skip
    out: dict[str, Any] = {}
    for label, quant in variants.items():
        model = build_model(dense_bench.MODELS[name], quant, s)
        weight_bytes = model_weight_bytes(model)
        rows = dense_bench.decode_bench(model, s)
        for r in rows:
            best = r["graph_ms"] or r["eager_ms"]
            r["weight_bytes"] = weight_bytes
            r["roofline_ms"] = (weight_bytes + r["kv_bytes"]) / (bandwidth * 1e9) * 1e3
            r["roofline_fraction"] = r["roofline_ms"] / best
        out[label] = rows
        print(f"{name} {label}: weights {weight_bytes / 2**30:.2f} GiB; "
              + ", ".join(f"batch {r['batch']} {r['graph_ms'] or r['eager_ms']:.2f} ms "
                          f"({r['roofline_fraction']:.0%} of roofline)" for r in rows))  # fmt: skip
        del model
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    for rows in out.values():
        for r, base in zip(rows, out["bf16"], strict=True):
            r["speedup_vs_bf16"] = (base["graph_ms"] or base["eager_ms"]) / (
                r["graph_ms"] or r["eager_ms"]
            )
    return out


def print_kernels(rows: list[dict[str, Any]]) -> None:
    print("layer    rows  bf16 ms | " + " | ".join(f"{f:>9s} ms  GB/s  x bf16" for f in FORMATS))
    for r in rows:
        cells = " | ".join(
            f"{r[f]['ms']:12.4f} {r[f]['gbs']:5.0f} {r[f]['vs_bf16']:6.2f}" for f in FORMATS
        )
        print(f"{r['layer']:8s} {r['rows']:4d} {r['bf16_ms']:8.4f} | {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized.gpu",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/quantized_gpu.json")
    parser.add_argument("--sweep", action="store_true", help="tile configurations too")
    parser.add_argument("--sweep-budget", type=float, default=240.0, help="seconds for --sweep")
    parser.add_argument("--no-model", action="store_true", help="kernels only")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (Triton's interpreter): checks the script")  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:  # before anything imports triton: the interpreter runs the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("benchmarks.quantized.gpu: no CUDA device on this machine, nothing measured. "
              "--smoke checks the script on the CPU.")  # fmt: skip
        return 0
    import triton

    s = dense_bench.Settings(args.smoke)
    s.batches = [1, 2] if args.smoke else [1, 16, 64]
    stats = dense_bench.measure_device(s)
    bandwidth = stats["copy_bandwidth_gbs"]
    layers = SMOKE_LAYERS if args.smoke else LAYERS
    rows_list = [1, 7] if args.smoke else [1, 16, 64, 256, 2048]
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu (smoke)",
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "dtype": str(s.dtype).removeprefix("torch."), **stats,
    }  # fmt: skip
    results["kernels"] = kernel_table(s.device, s.dtype, layers, rows_list, bandwidth, args.smoke)
    print(f"device: {results['device']}  copy {bandwidth:.0f} GB/s")
    print_kernels(results["kernels"])
    if args.sweep:
        results["sweep"] = sweep(s.device, s.dtype, layers, args.smoke, args.sweep_budget)
    if not args.no_model:
        results["model"] = model_decode("tiny" if args.smoke else "llama8b", s, bandwidth)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
